//! Static checks on compiled programs: which fp8 properties a kernel has, proven from the
//! program text without running it.
//!
//! [`inspect`] recognizes XLA HLO text, StableHLO (MLIR) and Mosaic TPU MLIR (what JAX Pallas
//! emits for the `tpu` platform), parses it leniently (what it does not understand is skipped;
//! no input makes it panic) and answers with a [`Report`]: a checklist of facts, each with the
//! lines that prove it. [`Report::expectations`] turns those facts into what a TPU fp8 kernel
//! variant ([`Variant`]) must show; [`Report::render`] prints both.
//!
//! ```
//! use fp8nsa::inspect::{inspect, ProgramFormat, Variant};
//!
//! let hlo = "HloModule m
//! ENTRY %main (a: u8[2,3], b: f8e4m3fn[3,4]) -> f32[2,4] {
//!   %a = u8[2,3]{1,0} parameter(0)
//!   %b = f8e4m3fn[3,4]{1,0} parameter(1)
//!   %x = f8e4m3fn[2,3]{1,0} bitcast-convert(%a)
//!   ROOT %d = f32[2,4]{1,0} dot(%x, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
//! }";
//! let report = inspect(hlo);
//! assert_eq!(report.format, ProgramFormat::HloText);
//! assert_eq!(report.native_fp8_dots, 1);
//! assert!(report.satisfies(Variant::V1));
//! assert!(!report.satisfies("v2".parse()?)); // no DMA, no VMEM double buffer
//! println!("{}", report.render(Some(Variant::V2)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::str::FromStr;

/// Evidence text is cut to this many characters.
const EVIDENCE_CHARS: usize = 160;
/// At most this many evidence lines per check (the detail gives the full count).
const MAX_EVIDENCE: usize = 8;
/// Instructions visited per dot while looking for an upcast: enough to cross fusions and
/// views, small enough that a huge program stays linear.
const TRACE_LIMIT: usize = 64;
/// A function signature longer than this is not one we can read.
const MAX_SIGNATURE_LINES: usize = 256;
/// Steps followed through slices/squeezes to find the buffer a DMA really uses.
const ROOT_STEPS: usize = 16;

// Fact names; the expectations reuse their verdicts and evidence.
const FP8: &str = "fp8 operands";
const DOT: &str = "native fp8 dot";
const ASYNC: &str = "async copies balanced";
const SPACES: &str = "memory spaces";
const DOUBLE: &str = "double-buffered VMEM";
const SCALES: &str = "f32 scales in SMEM";

/// The kind of program text [`inspect`] recognized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProgramFormat {
    /// XLA HLO text (`HloModule ...`, `%x = f32[2]{0} op(...)`).
    HloText,
    /// StableHLO or another MLIR module without TPU ops.
    StableHlo,
    /// Mosaic TPU MLIR (`tpu.*` ops, `#tpu.memory_space<...>`).
    Mosaic,
    /// Empty input or text in none of the above.
    Unknown,
}

impl fmt::Display for ProgramFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProgramFormat::HloText => "XLA HLO text",
            ProgramFormat::StableHlo => "StableHLO / MLIR",
            ProgramFormat::Mosaic => "Mosaic TPU MLIR",
            ProgramFormat::Unknown => "unrecognized program",
        })
    }
}

/// The TPU fp8 kernel variants (`FP8NSA_TPU_KERNEL=v1|v2|v3`); each adds to the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// fp8 weights in the program.
    V1,
    /// V1, with inputs left in HBM/ANY and moved by explicit, balanced DMAs into
    /// double-buffered VMEM.
    V2,
    /// V2, with the f32 block scales in SMEM.
    V3,
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Variant::V1 => "v1",
            Variant::V2 => "v2",
            Variant::V3 => "v3",
        })
    }
}

/// A string that is not `v1`, `v2` or `v3`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseVariantError(String);

impl fmt::Display for ParseVariantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown TPU fp8 kernel variant `{}`: expected v1, v2 or v3",
            self.0
        )
    }
}

impl std::error::Error for ParseVariantError {}

impl FromStr for Variant {
    type Err = ParseVariantError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "v1" => Ok(Variant::V1),
            "v2" => Ok(Variant::V2),
            "v3" => Ok(Variant::V3),
            _ => Err(ParseVariantError(s.to_string())),
        }
    }
}

/// One line of the checklist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
    /// `(1-based line, text)`: the line (or, in a long function signature, the argument that
    /// matters), whitespace collapsed, at most 160 characters (cut ones end in `…`).
    pub evidence: Vec<(usize, String)>,
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mark = if self.ok { "[ok]  " } else { "[FAIL]" };
        writeln!(f, "{mark} {}: {}", self.name, self.detail)?;
        for (line, text) in &self.evidence {
            writeln!(f, "         L{line}: {text}")?;
        }
        Ok(())
    }
}

/// Where a buffer comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferRole {
    /// An entry parameter / kernel operand.
    Parameter,
    /// A Mosaic scratch operand (the last `scratch_operands` arguments).
    Scratch,
    /// Allocated in the body (`memref.alloca`, `tpu.sem_alloc`, an HLO value placed in a
    /// non-default memory space).
    Allocation,
}

/// A parameter or buffer whose shape, element type and memory space the program states.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buffer {
    /// The value's name without `%`.
    pub name: String,
    pub role: BufferRole,
    /// `any`, `hbm`, `vmem`, `smem`, `semaphore_mem`, ... (Mosaic) or `S(n)` (HLO layouts;
    /// `S(0)` when none is written); `None` when the program does not say.
    pub space: Option<String>,
    /// Dimensions, `-1` for a dynamic one.
    pub dims: Vec<i64>,
    pub elem: String,
    pub evidence: (usize, String),
}

impl Buffer {
    fn shape(&self) -> String {
        let mut s: String = self.dims.iter().map(|d| format!("{d}x")).collect();
        s.push_str(&self.elem);
        s
    }

    fn class(&self) -> Space {
        self.space.as_deref().map_or(Space::Unknown, space_class)
    }
}

/// What [`inspect`] found: the recognized format, the checklist of facts, and the facts as
/// numbers.
#[derive(Clone, Debug)]
pub struct Report {
    pub format: ProgramFormat,
    /// Lines of input.
    pub lines: usize,
    /// The facts, in a fixed order: fp8 operands, native fp8 dot, async copies, memory
    /// spaces, double-buffered VMEM, f32 scales in SMEM (or one "program" line when the text
    /// was not recognized).
    pub checks: Vec<Check>,
    /// Distinct fp8 type spellings seen (`f8e4m3fn`, `f8E4M3FN`, ...).
    pub fp8_types: Vec<String>,
    /// dot / dot_general / convolution / matmul ops (and matmul-like custom calls).
    pub dots: usize,
    /// Dots with an fp8 operand.
    pub native_fp8_dots: usize,
    /// Dots fed by fp8 values converted to a wider float first.
    pub upcast_dots: usize,
    /// Async copy / DMA starts and dones (waits), counted in the text (not executions).
    pub async_starts: usize,
    pub async_dones: usize,
    /// Every start has a done/wait and every done/wait a start: in HLO the done names its
    /// start; in Mosaic the wait names the start's semaphore and destination buffer (traced
    /// back through slices), since a pipelined loop starts more copies in the text than it
    /// waits for.
    pub async_balanced: bool,
    /// Parameters / operands, Mosaic scratch operands, and allocations, in program order.
    pub buffers: Vec<Buffer>,
    start_evidence: Vec<(usize, String)>,
}

/// Reads a program text and reports its fp8 facts. Never panics; unrecognized or empty text
/// gives a report with [`ProgramFormat::Unknown`] that satisfies no variant.
pub fn inspect(text: &str) -> Report {
    let raw: Vec<&str> = text.lines().collect();
    let format = detect(text);
    if format == ProgramFormat::Unknown {
        return Report::unrecognized(&raw);
    }
    let program = Program::parse(format, &raw);
    Report::from_program(&program)
}

// ---------------------------------------------------------------------------------------------
// Report: facts, expectations, rendering
// ---------------------------------------------------------------------------------------------

impl Report {
    fn unrecognized(raw: &[&str]) -> Report {
        let first = raw
            .iter()
            .enumerate()
            .find(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| evidence(i + 1, l));
        let detail = if first.is_none() {
            "empty input".to_string()
        } else {
            "not XLA HLO text, StableHLO or Mosaic TPU MLIR (no HloModule, HLO instruction, \
             stablehlo.* op or tpu.* op found)"
                .to_string()
        };
        Report {
            format: ProgramFormat::Unknown,
            lines: raw.len(),
            checks: vec![Check {
                name: "program",
                ok: false,
                detail,
                evidence: first.into_iter().collect(),
            }],
            fp8_types: vec![],
            dots: 0,
            native_fp8_dots: 0,
            upcast_dots: 0,
            async_starts: 0,
            async_dones: 0,
            async_balanced: false,
            buffers: vec![],
            start_evidence: vec![],
        }
    }

    fn from_program(p: &Program) -> Report {
        let buffers = p.buffers();
        let (fp8_check, fp8_types) = p.fp8_fact(&buffers);
        let dots = p.dot_fact();
        let asyncs = p.async_fact(&buffers);
        let checks = vec![
            fp8_check,
            dots.check,
            asyncs.check,
            spaces_fact(&buffers),
            double_buffer_fact(&buffers),
            smem_scales_fact(&buffers),
        ];
        Report {
            format: p.format,
            lines: p.raw.len(),
            checks,
            fp8_types,
            dots: dots.total,
            native_fp8_dots: dots.native,
            upcast_dots: dots.upcast,
            async_starts: asyncs.starts.len(),
            async_dones: asyncs.dones,
            async_balanced: asyncs.balanced,
            buffers,
            start_evidence: asyncs.starts,
        }
    }

    fn fact(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// A fact restated as an expectation (false when the program was not recognized).
    fn expect_fact(&self, name: &'static str, fact: &str) -> Check {
        match self.fact(fact) {
            Some(c) => Check { name, ..c.clone() },
            None => Check {
                name,
                ok: false,
                detail: "no recognized program".into(),
                evidence: vec![],
            },
        }
    }

    /// What variant `v` requires of this program, one check per requirement:
    /// V1 `fp8 weights`; V2 adds `inputs left in HBM/ANY` (an operand in HBM/ANY and no fp8
    /// operand in VMEM), `DMA started`, `DMA starts and waits balance`,
    /// `double-buffered VMEM buffer` (a `[2, ...]` VMEM scratch); V3 adds `f32 scales in SMEM`.
    pub fn expectations(&self, v: Variant) -> Vec<Check> {
        let mut out = vec![self.expect_fact("fp8 weights", FP8)];
        if v == Variant::V1 {
            return out;
        }
        out.push(self.inputs_in_hbm());
        let started = !self.start_evidence.is_empty();
        out.push(Check {
            name: "DMA started",
            ok: started,
            detail: if started {
                format!("{} async copy/DMA start(s)", self.async_starts)
            } else {
                "no copy-start / tpu.enqueue_dma: nothing is moved by hand".into()
            },
            evidence: self
                .start_evidence
                .iter()
                .take(MAX_EVIDENCE)
                .cloned()
                .collect(),
        });
        out.push(self.expect_fact("DMA starts and waits balance", ASYNC));
        out.push(self.expect_fact("double-buffered VMEM buffer", DOUBLE));
        if v == Variant::V3 {
            out.push(self.expect_fact("f32 scales in SMEM", SCALES));
        }
        out
    }

    /// Operands left in HBM/ANY (so the kernel, not the pipeline, moves them), and no fp8
    /// operand copied into VMEM by the pipeline.
    fn inputs_in_hbm(&self) -> Check {
        let params: Vec<&Buffer> = self
            .buffers
            .iter()
            .filter(|b| b.role == BufferRole::Parameter)
            .collect();
        let in_hbm: Vec<&Buffer> = params
            .iter()
            .copied()
            .filter(|b| b.class() == Space::HbmOrAny)
            .collect();
        let fp8_in_vmem: Vec<&Buffer> = params
            .iter()
            .copied()
            .filter(|b| b.class() == Space::Vmem && is_fp8(&b.elem))
            .collect();
        let ok = !in_hbm.is_empty() && fp8_in_vmem.is_empty();
        let detail = if params.is_empty() {
            "no parameters found".to_string()
        } else if !fp8_in_vmem.is_empty() {
            format!(
                "fp8 operand(s) {} in VMEM: copied in by the pipeline",
                names(&fp8_in_vmem)
            )
        } else if params.iter().all(|b| b.space.is_none()) {
            "the operands' memory spaces are not stated".to_string()
        } else if in_hbm.is_empty() {
            "no operand in HBM/ANY: the pipeline copies every operand in".to_string()
        } else {
            format!("{} in HBM/ANY", names(&in_hbm))
        };
        let evidence = first_distinct(
            fp8_in_vmem
                .iter()
                .chain(&in_hbm)
                .chain(&params)
                .map(|b| b.evidence.clone()),
        );
        Check {
            name: "inputs left in HBM/ANY",
            ok,
            detail,
            evidence,
        }
    }

    /// Whether every expectation of `v` holds.
    pub fn satisfies(&self, v: Variant) -> bool {
        self.expectations(v).iter().all(|c| c.ok)
    }

    /// The checklist as text: one `[ok]`/`[FAIL]` line per fact with its evidence indented,
    /// then, with `expect`, that variant's expectations and the verdict.
    pub fn render(&self, expect: Option<Variant>) -> String {
        let mut out = format!("{} ({} lines)\n", self.format, self.lines);
        for c in &self.checks {
            out.push_str(&c.to_string());
        }
        if let Some(v) = expect {
            out.push_str(&format!("\nexpectations for {v}:\n"));
            let exp = self.expectations(v);
            for c in &exp {
                out.push_str(&c.to_string());
            }
            let failed = exp.iter().filter(|c| !c.ok).count();
            if failed == 0 {
                out.push_str(&format!("=> satisfies {v}\n"));
            } else {
                out.push_str(&format!(
                    "=> does NOT satisfy {v}: {failed} of {} expectations fail\n",
                    exp.len()
                ));
            }
        }
        out
    }
}

fn names(bufs: &[&Buffer]) -> String {
    let mut s: Vec<String> = bufs.iter().take(12).map(|b| b.name.clone()).collect();
    if bufs.len() > 12 {
        s.push(format!("(+{} more)", bufs.len() - 12));
    }
    s.join(", ")
}

/// The first `MAX_EVIDENCE` distinct items.
fn first_distinct<T: PartialEq>(items: impl IntoIterator<Item = T>) -> Vec<T> {
    let mut out = Vec::new();
    for x in items {
        if out.len() == MAX_EVIDENCE {
            break;
        }
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

fn evidence(line: usize, text: &str) -> (usize, String) {
    let t = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if t.chars().count() <= EVIDENCE_CHARS {
        (line, t)
    } else {
        let mut cut: String = t.chars().take(EVIDENCE_CHARS - 1).collect();
        cut.push('…');
        (line, cut)
    }
}

fn spaces_fact(bufs: &[Buffer]) -> Check {
    let known = |role| -> Vec<&Buffer> {
        bufs.iter()
            .filter(|b| b.role == role && b.space.is_some())
            .collect()
    };
    let sections = [
        ("parameters", known(BufferRole::Parameter)),
        ("scratch", known(BufferRole::Scratch)),
        ("allocations", known(BufferRole::Allocation)),
    ];
    let ok = !sections[0].1.is_empty() || !sections[1].1.is_empty();
    let mut parts = vec![];
    for (label, list) in &sections {
        if list.is_empty() {
            continue;
        }
        let mut items: Vec<String> = list
            .iter()
            .take(12)
            .map(|b| format!("{} {}", b.name, space_label(b.space.as_deref())))
            .collect();
        if list.len() > 12 {
            items.push(format!("(+{} more)", list.len() - 12));
        }
        parts.push(format!("{label}: {}", items.join(", ")));
    }
    let detail = if !parts.is_empty() {
        parts.join("; ")
    } else if bufs.is_empty() {
        "no parameters or buffers found".to_string()
    } else {
        "no memory space annotations (the device default)".to_string()
    };
    let evidence = first_distinct(
        sections
            .iter()
            .flat_map(|(_, l)| l.iter().map(|b| b.evidence.clone())),
    );
    Check {
        name: SPACES,
        ok,
        detail,
        evidence,
    }
}

/// Kernel-owned VMEM buffers (scratch, allocations) with two slots: `[2, ...]`. An operand
/// of that shape is data, not a double buffer.
fn double_buffer_fact(bufs: &[Buffer]) -> Check {
    let found: Vec<&Buffer> = bufs
        .iter()
        .filter(|b| b.role != BufferRole::Parameter && b.class() == Space::Vmem)
        .filter(|b| b.dims.len() >= 2 && b.dims[0] == 2)
        .collect();
    let detail = if found.is_empty() {
        "no VMEM scratch buffer with a leading dimension of 2".to_string()
    } else {
        let list: Vec<String> = found
            .iter()
            .take(12)
            .map(|b| format!("{} [{}]", b.name, b.shape()))
            .collect();
        format!("{} in VMEM", list.join(", "))
    };
    Check {
        name: DOUBLE,
        ok: !found.is_empty(),
        detail,
        evidence: found
            .iter()
            .take(MAX_EVIDENCE)
            .map(|b| b.evidence.clone())
            .collect(),
    }
}

fn smem_scales_fact(bufs: &[Buffer]) -> Check {
    let found: Vec<&Buffer> = bufs
        .iter()
        .filter(|b| b.class() == Space::Smem && b.elem == "f32")
        .collect();
    let detail = if found.is_empty() {
        "no f32 buffer in SMEM".to_string()
    } else {
        let list: Vec<String> = found
            .iter()
            .take(12)
            .map(|b| {
                let dbl = if b.dims.len() >= 2 && b.dims[0] == 2 {
                    ", double-buffered"
                } else {
                    ""
                };
                format!("{} [{}{}]", b.name, b.shape(), dbl)
            })
            .collect();
        format!("{} in SMEM", list.join(", "))
    };
    Check {
        name: SCALES,
        ok: !found.is_empty(),
        detail,
        evidence: found
            .iter()
            .take(MAX_EVIDENCE)
            .map(|b| b.evidence.clone())
            .collect(),
    }
}

// ---------------------------------------------------------------------------------------------
// Format detection
// ---------------------------------------------------------------------------------------------

fn detect(text: &str) -> ProgramFormat {
    let Some(first) = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("//"))
    else {
        return ProgramFormat::Unknown;
    };
    if first.starts_with("HloModule") {
        return ProgramFormat::HloText;
    }
    if ["#tpu.", "!tpu.", " tpu.", "\"tpu.", "stable_mosaic"]
        .iter()
        .any(|m| text.contains(m))
    {
        return ProgramFormat::Mosaic;
    }
    if ["stablehlo.", "mhlo.", "func.func"]
        .iter()
        .any(|m| text.contains(m))
    {
        return ProgramFormat::StableHlo;
    }
    if text
        .lines()
        .any(|l| parse_hlo_inst(&strip_comments(l)).is_some())
    {
        return ProgramFormat::HloText;
    }
    ProgramFormat::Unknown
}

// ---------------------------------------------------------------------------------------------
// The parsed program: instructions grouped in scopes (HLO computations, MLIR functions)
// ---------------------------------------------------------------------------------------------

struct Inst {
    /// 1-based.
    line: usize,
    scope: usize,
    /// The (first) result's name, without `%`.
    name: Option<String>,
    /// HLO opcode or MLIR op name (`dot`, `stablehlo.dot_general`, `tpu.enqueue_dma`).
    op: String,
    result_ty: String,
    /// Value names used, without `%`.
    operands: Vec<String>,
    /// Operand types written on the line (HLO inline types, the MLIR type signature).
    operand_tys: Vec<String>,
    /// HLO computations this instruction runs (`calls=`, `to_apply=` of a call).
    calls: Vec<String>,
    /// `n` of an HLO `parameter(n)`.
    param: Option<usize>,
}

struct Arg {
    name: String,
    ty: String,
    /// A memory space given as an argument attribute rather than in the type.
    space_attr: Option<String>,
    line: usize,
    fragment: String,
}

struct Scope {
    name: String,
    /// HLO ENTRY computation, or the MLIR kernel / main function.
    entry: bool,
    args: Vec<Arg>,
    /// Text after the argument list (results, `attributes {...}`).
    attrs: String,
    root: Option<usize>,
}

impl Scope {
    fn new(name: &str, entry: bool) -> Scope {
        Scope {
            name: name.to_string(),
            entry,
            args: vec![],
            attrs: String::new(),
            root: None,
        }
    }

    /// Mosaic puts the scratch buffers last; `scratch_operands = N` says how many.
    fn scratch_operands(&self) -> usize {
        let Some(at) = self.attrs.find("scratch_operands") else {
            return 0;
        };
        let rest = self.attrs[at + "scratch_operands".len()..].trim_start();
        let rest = rest.strip_prefix('=').unwrap_or(rest).trim_start();
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().unwrap_or(0)
    }
}

struct Program<'a> {
    format: ProgramFormat,
    raw: &'a [&'a str],
    /// The lines without comments.
    code: Vec<String>,
    insts: Vec<Inst>,
    scopes: Vec<Scope>,
    /// Per scope: value name -> defining instruction.
    defs: Vec<HashMap<String, usize>>,
    scope_ids: HashMap<String, usize>,
    /// Computation name -> instructions that call it.
    callers: HashMap<String, Vec<usize>>,
}

impl<'a> Program<'a> {
    fn parse(format: ProgramFormat, raw: &'a [&'a str]) -> Program<'a> {
        let code: Vec<String> = raw.iter().map(|l| strip_comments(l)).collect();
        let (insts, scopes) = match format {
            ProgramFormat::HloText => parse_hlo(&code),
            _ => parse_mlir(&code),
        };
        let mut defs = vec![HashMap::new(); scopes.len()];
        let mut callers: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, inst) in insts.iter().enumerate() {
            if let Some(n) = &inst.name {
                defs[inst.scope].insert(n.clone(), i);
            }
            for c in &inst.calls {
                callers.entry(c.clone()).or_default().push(i);
            }
        }
        let scope_ids = scopes
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        Program {
            format,
            raw,
            code,
            insts,
            scopes,
            defs,
            scope_ids,
            callers,
        }
    }

    fn ev(&self, line: usize) -> (usize, String) {
        evidence(line, self.raw.get(line - 1).copied().unwrap_or(""))
    }

    fn def(&self, scope: usize, name: &str) -> Option<usize> {
        self.defs.get(scope)?.get(name).copied()
    }

    fn type_of(&self, scope: usize, name: &str) -> Option<&str> {
        if let Some(d) = self.def(scope, name) {
            return Some(&self.insts[d].result_ty);
        }
        let s = self.scopes.get(scope)?;
        s.args
            .iter()
            .find(|a| a.name == name)
            .map(|a| a.ty.as_str())
    }

    /// Operand types: written on the line, or those of the values the operands name.
    fn operand_types(&self, inst: &Inst) -> Vec<String> {
        let mut tys: Vec<String> = inst
            .operand_tys
            .iter()
            .filter(|t| !t.is_empty())
            .cloned()
            .collect();
        for o in &inst.operands {
            if let Some(t) = self.type_of(inst.scope, o) {
                tys.push(t.to_string());
            }
        }
        tys
    }

    fn fp8_operand(&self, inst: &Inst) -> Option<String> {
        self.operand_types(inst)
            .into_iter()
            .map(|t| elem_type(&t))
            .find(|e| is_fp8(e))
    }

    fn is_dot(&self, inst: &Inst) -> bool {
        let base = inst.op.rsplit('.').next().unwrap_or("");
        match base {
            "dot" | "dot_general" | "convolution" | "matmul" | "batch_matmul" | "contract" => true,
            "custom-call" | "custom_call" => {
                let target = custom_call_target(&self.code[inst.line - 1]).to_ascii_lowercase();
                ["gemm", "matmul", "dot"].iter().any(|k| target.contains(k))
                    || self.fp8_operand(inst).is_some()
            }
            _ => false,
        }
    }

    /// A convert of fp8 values to a wider float: returns that float type.
    fn upcast(&self, inst: &Inst) -> Option<String> {
        let op = inst.op.as_str();
        let convert = op == "convert"
            || op.ends_with(".convert")
            || op.ends_with(".extf")
            || op.ends_with(".fpext");
        if !convert {
            return None;
        }
        let to = elem_type(&inst.result_ty);
        (is_wide_float(&to) && self.fp8_operand(inst).is_some()).then_some(to)
    }

    /// Instructions whose values flow into `n`: its operands, the root of a computation it
    /// calls, and, for a parameter of a called computation, the caller's operand.
    fn preds(&self, n: usize) -> Vec<usize> {
        let inst = &self.insts[n];
        let mut out = vec![];
        for c in &inst.calls {
            if let Some(r) = self.scope_ids.get(c).and_then(|&s| self.scopes[s].root) {
                out.push(r);
            }
        }
        let scope = &self.scopes[inst.scope];
        if let (Some(k), false) = (inst.param, scope.entry) {
            for &caller in self.callers.get(&scope.name).into_iter().flatten() {
                let c = &self.insts[caller];
                if let Some(d) = c.operands.get(k).and_then(|o| self.def(c.scope, o)) {
                    out.push(d);
                }
            }
        }
        out.extend(inst.operands.iter().filter_map(|o| self.def(inst.scope, o)));
        out
    }

    /// Looks upstream of a dot for an fp8 -> wider-float convert; returns the path
    /// convert .. dot.
    fn trace_upcast(&self, dot: usize) -> Option<Vec<usize>> {
        let mut parent: HashMap<usize, usize> = HashMap::new();
        let mut seen: HashSet<usize> = HashSet::from([dot]);
        let mut queue = VecDeque::from([dot]);
        while let Some(n) = queue.pop_front() {
            if n != dot {
                if self.upcast(&self.insts[n]).is_some() {
                    let mut path = vec![n];
                    while let Some(&p) = parent.get(path.last()?) {
                        path.push(p);
                    }
                    return Some(path);
                }
                if self.is_dot(&self.insts[n]) {
                    continue; // another dot's inputs are its own business
                }
            }
            for p in self.preds(n) {
                if seen.len() >= TRACE_LIMIT {
                    return None;
                }
                if seen.insert(p) {
                    parent.insert(p, n);
                    queue.push_back(p);
                }
            }
        }
        None
    }

    /// The value a DMA really reads or writes: follows slices, squeezes and casts back to
    /// the argument or allocation they view.
    fn root(&self, scope: usize, name: &str) -> String {
        let mut name = name.to_string();
        for _ in 0..ROOT_STEPS {
            let Some(d) = self.def(scope, &name) else {
                break;
            };
            let inst = &self.insts[d];
            let view = ["slice", "squeeze", "reshape", "bitcast", "view", "cast"]
                .iter()
                .any(|k| inst.op.contains(k));
            match inst.operands.first() {
                Some(o) if view => name = o.clone(),
                _ => break,
            }
        }
        name
    }

    fn buffers(&self) -> Vec<Buffer> {
        match self.format {
            ProgramFormat::HloText => self.hlo_buffers(),
            _ => self.mlir_buffers(),
        }
    }

    /// HLO: the ENTRY parameters, and values placed in a non-default memory space.
    fn hlo_buffers(&self) -> Vec<Buffer> {
        let mut out = vec![];
        for inst in &self.insts {
            let entry = self.scopes[inst.scope].entry;
            let arrays = hlo_arrays(&inst.result_ty);
            let pick = if inst.op == "parameter" {
                if !entry {
                    continue;
                }
                arrays
                    .into_iter()
                    .next()
                    .map(|a| (a, BufferRole::Parameter))
            } else {
                arrays
                    .into_iter()
                    .find(|a| a.space != "S(0)")
                    .map(|a| (a, BufferRole::Allocation))
            };
            if let (Some((a, role)), Some(name)) = (pick, &inst.name) {
                out.push(Buffer {
                    name: name.clone(),
                    role,
                    space: Some(a.space),
                    dims: a.dims,
                    elem: a.elem,
                    evidence: self.ev(inst.line),
                });
            }
        }
        out
    }

    /// MLIR: the entry function's shaped arguments (the last `scratch_operands` are
    /// scratch), and allocations in any function.
    fn mlir_buffers(&self) -> Vec<Buffer> {
        let mut out = vec![];
        if let Some(scope) = self.scopes.iter().find(|s| s.entry) {
            let first_scratch = scope.args.len().saturating_sub(scope.scratch_operands());
            for (k, a) in scope.args.iter().enumerate() {
                let Some(sh) = shaped(&a.ty) else { continue };
                out.push(Buffer {
                    name: a.name.clone(),
                    role: if k >= first_scratch {
                        BufferRole::Scratch
                    } else {
                        BufferRole::Parameter
                    },
                    space: sh.space.or_else(|| a.space_attr.clone()),
                    dims: sh.dims,
                    elem: sh.elem,
                    evidence: evidence(a.line, &a.fragment),
                });
            }
        }
        for inst in self.insts.iter().filter(|i| i.op.contains("alloc")) {
            let (Some(sh), Some(name)) = (shaped(&inst.result_ty), &inst.name) else {
                continue;
            };
            out.push(Buffer {
                name: name.clone(),
                role: BufferRole::Allocation,
                space: sh.space,
                dims: sh.dims,
                elem: sh.elem,
                evidence: self.ev(inst.line),
            });
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// The facts read from instructions
// ---------------------------------------------------------------------------------------------

struct DotFact {
    check: Check,
    total: usize,
    native: usize,
    upcast: usize,
}

struct AsyncFact {
    check: Check,
    starts: Vec<(usize, String)>,
    dones: usize,
    balanced: bool,
}

/// What a DMA start or wait names: its semaphore and its destination buffer (roots).
type DmaKey = (Option<String>, Option<String>);

impl Program<'_> {
    fn fp8_fact(&self, buffers: &[Buffer]) -> (Check, Vec<String>) {
        let mut types: Vec<String> = vec![];
        let mut seen: HashSet<String> = HashSet::new();
        let mut fp8_lines = vec![];
        for (i, l) in self.code.iter().enumerate() {
            let found = fp8_types_in(l);
            if !found.is_empty() {
                fp8_lines.push(i + 1);
            }
            for t in found {
                if seen.insert(t.clone()) {
                    types.push(t);
                }
            }
        }
        // How the fp8 values get there: bitcasts of bytes, fp8 parameters, in-program
        // quantization; each with its evidence.
        let mut how: Vec<((usize, String), String)> = vec![];
        for inst in &self.insts {
            let to = elem_type(&inst.result_ty);
            if !is_fp8(&to) {
                continue;
            }
            let from: Vec<String> = self
                .operand_types(inst)
                .iter()
                .map(|t| elem_type(t))
                .collect();
            if inst.op.contains("bitcast") {
                if let Some(f) = from.iter().find(|e| is_int8(e)) {
                    how.push((
                        self.ev(inst.line),
                        format!("bitcast from {f} ({})", inst.op),
                    ));
                }
            } else if self.upcast(inst).is_none() && inst.op.contains("convert") {
                if let Some(f) = from.iter().find(|e| is_wide_float(e)) {
                    how.push((
                        self.ev(inst.line),
                        format!("quantized from {f} ({})", inst.op),
                    ));
                }
            }
        }
        for b in buffers.iter().filter(|b| is_fp8(&b.elem)) {
            let what = format!("fp8 {:?} {}", b.role, b.name).to_lowercase();
            how.push((b.evidence.clone(), what));
        }
        let ok = !fp8_lines.is_empty();
        let detail = if !ok {
            "no fp8 values (no f8e4m3fn / f8E4M3FN type anywhere)".to_string()
        } else {
            let ways: Vec<String> = how
                .iter()
                .take(4)
                .map(|((line, _), w)| format!("{w} at line {line}"))
                .collect();
            let ways = if ways.is_empty() {
                "no bitcast from bytes and no fp8 parameter".to_string()
            } else {
                ways.join("; ")
            };
            format!(
                "{} on {} line(s); {}",
                types.join(", "),
                fp8_lines.len(),
                ways
            )
        };
        // The sources first, then other lines with fp8 types.
        let mut evidence = first_distinct(how.into_iter().map(|(e, _)| e));
        for &line in &fp8_lines {
            if evidence.len() >= MAX_EVIDENCE {
                break;
            }
            if evidence.iter().all(|(l, _)| *l != line) {
                evidence.push(self.ev(line));
            }
        }
        let check = Check {
            name: FP8,
            ok,
            detail,
            evidence,
        };
        (check, types)
    }

    fn dot_fact(&self) -> DotFact {
        let mut total = 0;
        let mut native = vec![];
        let mut upcasts = vec![];
        for (i, inst) in self.insts.iter().enumerate() {
            if !self.is_dot(inst) {
                continue;
            }
            total += 1;
            if self.fp8_operand(inst).is_some() {
                native.push(i);
            } else if let Some(path) = self.trace_upcast(i) {
                upcasts.push(path);
            }
        }
        let mut evidence = vec![];
        let detail = if total == 0 {
            "no dot / dot_general / convolution / matmul in the program".to_string()
        } else if !native.is_empty() {
            for &i in &native {
                evidence.push(self.ev(self.insts[i].line));
            }
            let mut d = format!(
                "{} of {total} dot(s) take fp8 operands directly",
                native.len()
            );
            if !upcasts.is_empty() {
                d.push_str(&format!("; {} take upcast fp8", upcasts.len()));
            }
            d
        } else if let Some(path) = upcasts.first() {
            self.upcast_detail(path, upcasts.len(), total, &mut evidence)
        } else {
            format!("{total} dot(s), none fed by fp8 values")
        };
        // A Pallas kernel inside HLO/StableHLO: its body is serialized, so say where to look.
        let kernels: Vec<usize> = self
            .insts
            .iter()
            .filter(|i| custom_call_target(&self.code[i.line - 1]) == "tpu_custom_call")
            .map(|i| i.line)
            .collect();
        let mut detail = detail;
        if let Some(&line) = kernels.first() {
            detail.push_str(&format!(
                "; {} tpu_custom_call(s) (first at line {line}): Mosaic kernels whose body is \
                 not in this text, inspect their Mosaic dump",
                kernels.len()
            ));
            evidence.push(self.ev(line));
        }
        evidence.truncate(MAX_EVIDENCE);
        DotFact {
            check: Check {
                name: DOT,
                ok: !native.is_empty(),
                detail,
                evidence,
            },
            total,
            native: native.len(),
            upcast: upcasts.len(),
        }
    }

    /// Describes the first upcast path (convert .. fusions .. dot) and collects its lines.
    fn upcast_detail(
        &self,
        path: &[usize],
        count: usize,
        total: usize,
        evidence: &mut Vec<(usize, String)>,
    ) -> String {
        let convert = &self.insts[path[0]];
        let to = self.upcast(convert).unwrap_or_default();
        let dot = &self.insts[path[path.len() - 1]];
        let via: Vec<&Inst> = path[1..path.len() - 1]
            .iter()
            .map(|&i| &self.insts[i])
            .filter(|i| !i.calls.is_empty())
            .collect();
        evidence.push(self.ev(convert.line));
        evidence.extend(via.iter().map(|i| self.ev(i.line)));
        evidence.push(self.ev(dot.line));
        let mut d = format!(
            "upcast to {to} before the dot: {} at line {}",
            convert.op, convert.line
        );
        if convert.scope != dot.scope {
            d.push_str(&format!(" (in {})", self.scopes[convert.scope].name));
        }
        for i in &via {
            d.push_str(&format!(", {} at line {}", i.op, i.line));
        }
        d.push_str(&format!(" feeds {} at line {}", dot.op, dot.line));
        if count > 1 || total > 1 {
            d.push_str(&format!(" ({count} of {total} dots fed this way)"));
        }
        d
    }

    fn async_fact(&self, buffers: &[Buffer]) -> AsyncFact {
        let mut starts = vec![];
        let mut dones = vec![];
        for (i, inst) in self.insts.iter().enumerate() {
            match async_kind(&inst.op) {
                Some(true) => starts.push(i),
                Some(false) => dones.push(i),
                None => {}
            }
        }
        let (balanced, how) = if starts.is_empty() && dones.is_empty() {
            (true, "no async copy or DMA".to_string())
        } else if self.format == ProgramFormat::HloText
            || starts.iter().any(|&i| self.insts[i].op.ends_with("start"))
        {
            self.pairs_by_token(&starts, &dones)
        } else {
            self.pairs_by_semaphore(&starts, &dones)
        };
        let sems = buffers
            .iter()
            .filter(|b| b.elem.contains("semaphore"))
            .count();
        let mut detail = format!(
            "{} start(s), {} done/wait(s) in the text",
            starts.len(),
            dones.len()
        );
        if sems > 0 {
            detail.push_str(&format!(", {sems} semaphore buffer(s)"));
        }
        detail.push_str(if balanced {
            "; balanced: "
        } else {
            "; NOT balanced: "
        });
        detail.push_str(&how);
        let start_ev: Vec<(usize, String)> = starts
            .iter()
            .map(|&i| self.ev(self.insts[i].line))
            .collect();
        let evidence = starts
            .iter()
            .take(MAX_EVIDENCE / 2)
            .chain(dones.iter().take(MAX_EVIDENCE / 2))
            .map(|&i| self.ev(self.insts[i].line))
            .collect();
        AsyncFact {
            check: Check {
                name: ASYNC,
                ok: balanced,
                detail,
                evidence,
            },
            starts: start_ev,
            dones: dones.len(),
            balanced,
        }
    }

    /// HLO style: a done names the start it completes.
    fn pairs_by_token(&self, starts: &[usize], dones: &[usize]) -> (bool, String) {
        let operand = |i: usize| self.insts[i].operands.first().map(String::as_str);
        let name = |i: usize| self.insts[i].name.as_deref();
        let started: HashSet<&str> = starts.iter().filter_map(|&i| name(i)).collect();
        let completed: HashSet<&str> = dones.iter().filter_map(|&i| operand(i)).collect();
        let unfinished: Vec<usize> = starts
            .iter()
            .filter(|&&i| !name(i).is_some_and(|n| completed.contains(n)))
            .map(|&i| self.insts[i].line)
            .collect();
        let orphans: Vec<usize> = dones
            .iter()
            .filter(|&&i| !operand(i).is_some_and(|o| started.contains(o)))
            .map(|&i| self.insts[i].line)
            .collect();
        pairing_verdict(&unfinished, &orphans, "each done completes a start")
    }

    /// Mosaic: a DMA start and a wait match when they name the same semaphore and the same
    /// destination buffer. Counting the ops in the text would not do: a pipelined loop
    /// starts the first copy before the loop and the next ones inside it.
    fn pairs_by_semaphore(&self, starts: &[usize], dones: &[usize]) -> (bool, String) {
        let keys = |list: &[usize], start| -> Vec<DmaKey> {
            list.iter().map(|&i| self.dma_key(i, start)).collect()
        };
        let (sk, dk) = (keys(starts, true), keys(dones, false));
        if sk
            .iter()
            .chain(&dk)
            .all(|(s, d)| s.is_none() && d.is_none())
        {
            let ok = starts.len() == dones.len();
            return (ok, "semaphores not readable, counts compared".to_string());
        }
        let fits = |a: &DmaKey, b: &DmaKey| {
            let same = |x: &Option<String>, y: &Option<String>| match (x, y) {
                (Some(x), Some(y)) => x == y,
                _ => true,
            };
            same(&a.0, &b.0) && same(&a.1, &b.1)
        };
        let unwaited: Vec<usize> = starts
            .iter()
            .zip(&sk)
            .filter(|(_, k)| !dk.iter().any(|d| fits(k, d)))
            .map(|(&i, _)| self.insts[i].line)
            .collect();
        let unstarted: Vec<usize> = dones
            .iter()
            .zip(&dk)
            .filter(|(_, k)| !sk.iter().any(|s| fits(s, k)))
            .map(|(&i, _)| self.insts[i].line)
            .collect();
        pairing_verdict(
            &unwaited,
            &unstarted,
            "every start has a wait on the same semaphore and buffer",
        )
    }

    fn dma_key(&self, i: usize, start: bool) -> DmaKey {
        let inst = &self.insts[i];
        let text = &self.code[inst.line - 1];
        let (mut sem, mut dst) = if start {
            (
                named_value(text, "target_semaphore"),
                named_value(text, "target"),
            )
        } else {
            (named_value(text, "semaphore"), named_value(text, "dst"))
        };
        // `tpu.wait_dma %sem, %ref` names them by position.
        if !start && sem.is_none() && inst.op.ends_with("wait_dma") {
            sem = inst.operands.first().cloned();
            dst = inst.operands.get(1).cloned();
        }
        let root = |v: Option<String>| v.map(|n| self.root(inst.scope, &n));
        (root(sem), root(dst))
    }
}

/// Balanced when no start lacks its done/wait and no done/wait lacks its start.
fn pairing_verdict(unfinished: &[usize], orphans: &[usize], ok: &str) -> (bool, String) {
    let lines = |v: &[usize]| {
        v.iter()
            .take(12)
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match (unfinished.is_empty(), orphans.is_empty()) {
        (true, true) => (true, ok.to_string()),
        (false, _) => (
            false,
            format!(
                "no done/wait for the start(s) at line(s) {}",
                lines(unfinished)
            ),
        ),
        (true, false) => (
            false,
            format!(
                "no start for the done/wait(s) at line(s) {}",
                lines(orphans)
            ),
        ),
    }
}

/// `Some(true)` for an async copy / DMA start, `Some(false)` for its done / wait.
fn async_kind(op: &str) -> Option<bool> {
    let base = op.rsplit('.').next().unwrap_or(op);
    if base.ends_with("copy-start")
        || matches!(base, "async-start" | "async_start" | "copy_start")
        || base.starts_with("enqueue_") && base.ends_with("dma")
    {
        Some(true)
    } else if base.ends_with("copy-done")
        || matches!(base, "async-done" | "async_done" | "copy_done")
        || base.starts_with("wait_") && base.contains("dma")
    {
        Some(false)
    } else {
        None
    }
}

// ---------------------------------------------------------------------------------------------
// HLO text
// ---------------------------------------------------------------------------------------------

struct HloLine<'s> {
    root: bool,
    name: &'s str,
    ty: &'s str,
    op: &'s str,
    args: &'s str,
    attrs: &'s str,
}

fn is_hlo_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}

/// `[ROOT] %name = type opcode(operands), attrs`; `None` for anything else.
fn parse_hlo_inst(line: &str) -> Option<HloLine<'_>> {
    let t = line.trim();
    let (root, t) = match t.strip_prefix("ROOT ") {
        Some(r) => (true, r.trim_start()),
        None => (false, t),
    };
    let eq = t.find(" = ")?;
    let name = t[..eq].trim().trim_start_matches('%');
    if name.is_empty() || !name.chars().all(is_hlo_name_char) {
        return None;
    }
    let rest = t[eq + 3..].trim_start();
    let ty_len = if rest.starts_with('(') {
        matching(rest, 0)? + 1
    } else {
        let n = rest.find(char::is_whitespace)?;
        let lb = rest[..n].find('[')?;
        if lb == 0 || !rest[..lb].chars().all(|c| c.is_ascii_alphanumeric()) {
            return None;
        }
        n
    };
    let ty = &rest[..ty_len];
    let after = rest[ty_len..].trim_start();
    let open = after.find('(')?;
    let op = &after[..open];
    if op.is_empty()
        || !op
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return None;
    }
    let close = matching(after, open)?;
    Some(HloLine {
        root,
        name,
        ty,
        op,
        args: &after[open + 1..close],
        attrs: &after[close + 1..],
    })
}

/// `[ENTRY] %name (params) -> type {`: the computation's name.
fn parse_hlo_header(t: &str) -> Option<(String, bool)> {
    if !t.ends_with('{') || t.starts_with("HloModule") {
        return None;
    }
    let (entry, rest) = match t.strip_prefix("ENTRY") {
        Some(r) => (true, r.trim_start()),
        None => (false, t),
    };
    let end = rest.find(|c: char| c.is_whitespace() || c == '(' || c == '{')?;
    let name = rest[..end].trim_start_matches('%');
    (!name.is_empty() && name.chars().all(is_hlo_name_char)).then(|| (name.to_string(), entry))
}

/// Values of `key=` in an HLO attribute list: `calls=%f` or `calls={%a, %b}`.
fn hlo_attr_names(attrs: &str, key: &str) -> Vec<String> {
    let mut out = vec![];
    let mut from = 0;
    while let Some(at) = attrs[from..].find(key).map(|a| a + from) {
        from = at + key.len();
        let before = attrs[..at].chars().next_back();
        if before.is_some_and(|c| !(c == ' ' || c == ',')) {
            continue;
        }
        let v = &attrs[from..];
        let v = if v.starts_with('{') {
            matching(v, 0).map_or("", |c| &v[1..c])
        } else {
            v.split([',', ' ']).next().unwrap_or("")
        };
        out.extend(
            v.split(',')
                .map(|n| n.trim().trim_start_matches('%').to_string())
                .filter(|n| !n.is_empty()),
        );
    }
    out
}

fn hlo_inst(h: &HloLine<'_>, line: usize, scope: usize) -> Inst {
    let mut operands = vec![];
    let mut operand_tys = vec![];
    for piece in split_top(h.args, b',') {
        let piece = piece.trim();
        let name = piece.rsplit(char::is_whitespace).next().unwrap_or("");
        if name.is_empty() {
            continue;
        }
        operand_tys.push(piece[..piece.len() - name.len()].trim().to_string());
        operands.push(name.trim_start_matches('%').to_string());
    }
    let mut calls = hlo_attr_names(h.attrs, "calls=");
    if h.op == "call" {
        calls.extend(hlo_attr_names(h.attrs, "to_apply="));
    }
    Inst {
        line,
        scope,
        name: Some(h.name.to_string()),
        op: h.op.to_string(),
        result_ty: h.ty.to_string(),
        operands,
        operand_tys,
        calls,
        param: (h.op == "parameter")
            .then(|| h.args.trim().parse().ok())
            .flatten(),
    }
}

fn parse_hlo(code: &[String]) -> (Vec<Inst>, Vec<Scope>) {
    let mut insts = vec![];
    let mut scopes: Vec<Scope> = vec![];
    let mut cur: Option<usize> = None;
    for (i, line) in code.iter().enumerate() {
        let t = line.trim();
        if t.is_empty() || t.starts_with("HloModule") {
            continue;
        }
        if t == "}" {
            cur = None;
        } else if let Some(h) = parse_hlo_inst(t) {
            // Instructions outside any computation (a bare listing) form an entry of their own.
            let scope = *cur.get_or_insert_with(|| {
                scopes.push(Scope::new("<top>", true));
                scopes.len() - 1
            });
            if h.root {
                scopes[scope].root = Some(insts.len());
            }
            insts.push(hlo_inst(&h, i + 1, scope));
        } else if let Some((name, entry)) = parse_hlo_header(t) {
            scopes.push(Scope::new(&name, entry));
            cur = Some(scopes.len() - 1);
        }
    }
    // Without a ROOT marker, the last instruction is the result.
    let mut last: HashMap<usize, usize> = HashMap::new();
    for (i, inst) in insts.iter().enumerate() {
        last.insert(inst.scope, i);
    }
    for (s, i) in last {
        if scopes[s].root.is_none() {
            scopes[s].root = Some(i);
        }
    }
    (insts, scopes)
}

struct HloArray {
    dims: Vec<i64>,
    elem: String,
    space: String,
}

/// The array types of an HLO shape (a tuple's elements, flattened), with their memory space
/// (`S(n)` from the layout, `S(0)` when none is written).
fn hlo_arrays(ty: &str) -> Vec<HloArray> {
    tuple_arrays(ty, 0)
}

/// Real shapes nest tuples two or three deep; the bound keeps hostile input linear.
const MAX_TUPLE_DEPTH: usize = 8;

fn tuple_arrays(ty: &str, depth: usize) -> Vec<HloArray> {
    let ty = ty.trim();
    if ty.starts_with('(') {
        let inner = match matching(ty, 0) {
            Some(c) if depth < MAX_TUPLE_DEPTH => &ty[1..c],
            _ => return vec![],
        };
        return split_top(inner, b',')
            .into_iter()
            .flat_map(|t| tuple_arrays(t, depth + 1))
            .collect();
    }
    let (Some(lb), Some(rb)) = (ty.find('['), ty.find(']')) else {
        return vec![];
    };
    if rb < lb {
        return vec![];
    }
    let dims = ty[lb + 1..rb]
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.trim_start_matches("<=").parse().unwrap_or(-1))
        .collect();
    let layout = &ty[rb + 1..];
    let space = layout
        .find(':')
        .and_then(|c| layout[c..].find("S(").map(|s| c + s + 2))
        .map(|s| {
            let n: String = layout[s..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            format!("S({n})")
        })
        .unwrap_or_else(|| "S(0)".to_string());
    vec![HloArray {
        dims,
        elem: ty[..lb].to_string(),
        space,
    }]
}

// ---------------------------------------------------------------------------------------------
// MLIR (StableHLO, Mosaic)
// ---------------------------------------------------------------------------------------------

fn is_func_start(t: &str) -> bool {
    t.starts_with("func.func") || t.starts_with("func ") || t.starts_with("func @")
}

fn parse_mlir(code: &[String]) -> (Vec<Inst>, Vec<Scope>) {
    let mut insts = vec![];
    let mut scopes: Vec<Scope> = vec![];
    let mut cur: Option<usize> = None;
    let mut i = 0;
    while i < code.len() {
        let t = code[i].trim();
        if is_func_start(t) {
            let (scope, next) = parse_func(code, i);
            scopes.push(scope);
            cur = Some(scopes.len() - 1);
            i = next;
            continue;
        }
        if let Some(mut inst) = parse_mlir_inst(t) {
            inst.line = i + 1;
            inst.scope = *cur.get_or_insert_with(|| {
                scopes.push(Scope::new("<module>", false));
                scopes.len() - 1
            });
            insts.push(inst);
        }
        i += 1;
    }
    // The kernel is the function Pallas gave grid/scratch attributes; else `main`; else the
    // first function that is not a BlockSpec index map.
    let kernel_attr = [
        "scratch_operands",
        "dimension_semantics",
        "window_params",
        "iteration_bounds",
    ];
    let entry = scopes
        .iter()
        .position(|s| kernel_attr.iter().any(|k| s.attrs.contains(k)))
        .or_else(|| scopes.iter().position(|s| s.name == "main"))
        .or_else(|| {
            scopes
                .iter()
                .position(|s| s.name != "<module>" && !s.name.starts_with("transform_"))
        });
    if let Some(e) = entry {
        scopes[e].entry = true;
    }
    (insts, scopes)
}

/// Reads `func.func @name(%arg0: type {attrs}, ...) -> results attributes {...} {` (over as
/// many lines as it spans); returns the scope and the index of the first body line.
fn parse_func(code: &[String], start: usize) -> (Scope, usize) {
    let mut joined = String::new();
    let mut starts = vec![];
    let mut end = start;
    let mut d = 0;
    for (j, line) in code
        .iter()
        .enumerate()
        .skip(start)
        .take(MAX_SIGNATURE_LINES)
    {
        starts.push(joined.len());
        joined.push_str(line.trim_end());
        joined.push('\n');
        end = j;
        d += depth(line);
        if d <= 0 || (d == 1 && line.trim_end().ends_with('{')) {
            break;
        }
    }
    let line_of = |off: usize| start + starts.partition_point(|&s| s <= off);
    let name_at = joined.find('@').map(|a| a + 1);
    let name: String = name_at
        .map(|a| {
            joined[a..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '$' | '-'))
                .collect()
        })
        .unwrap_or_default();
    let mut scope = Scope::new(&name, false);
    let open = name_at.and_then(|a| joined[a..].find('(').map(|o| a + o));
    let Some((open, close)) = open.and_then(|o| Some((o, matching(&joined, o)?))) else {
        return (scope, end + 1);
    };
    for piece in split_top(&joined[open + 1..close], b',') {
        // The piece starts after the comma, maybe on the line before the argument.
        let piece = piece.trim();
        let off = piece.as_ptr() as usize - joined.as_ptr() as usize;
        if let Some(arg) = parse_arg(piece, line_of(off)) {
            scope.args.push(arg);
        }
    }
    scope.attrs = joined[close + 1..].to_string();
    (scope, end + 1)
}

/// `%name: type {attrs}`.
fn parse_arg(piece: &str, line: usize) -> Option<Arg> {
    let rest = piece.strip_prefix('%')?;
    let colon = find_top(rest, ":")?;
    let name = rest[..colon].trim().to_string();
    let after = rest[colon + 1..].trim();
    let ty_end = find_top(after, "{")
        .or_else(|| find_top(after, " loc("))
        .unwrap_or(after.len());
    let attrs = &after[ty_end..];
    Some(Arg {
        name,
        ty: after[..ty_end].trim().to_string(),
        space_attr: memory_space_in(attrs),
        line,
        fragment: piece.to_string(),
    })
}

/// One MLIR operation line: `%r = dialect.op operands attrs : type-signature`.
fn parse_mlir_inst(t: &str) -> Option<Inst> {
    let mut t = t.trim();
    if t.is_empty() || t.starts_with('}') || t.starts_with('^') || t.starts_with("module") {
        return None;
    }
    if let Some(l) = find_top(t, " loc(").filter(|_| t.ends_with(')')) {
        t = t[..l].trim_end();
    }
    let (names, rest) = if t.starts_with('%') {
        let eq = find_top(t, " = ")?;
        (value_names(&t[..eq]), t[eq + 3..].trim_start())
    } else {
        (vec![], t)
    };
    let (op, after) = if let Some(q) = rest.strip_prefix('"') {
        let e = q.find('"')?;
        (&q[..e], &q[e + 1..])
    } else {
        let e = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '_'))
            .unwrap_or(rest.len());
        (&rest[..e], &rest[e..])
    };
    if !op.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return None;
    }
    let (body, sig) = match find_top(after, " : ") {
        Some(p) => (&after[..p], after[p + 3..].trim()),
        None => (after, ""),
    };
    let (operand_tys, result_tys) = parse_sig(sig.trim_end_matches('{').trim());
    Some(Inst {
        line: 0,
        scope: 0,
        name: names.into_iter().next(),
        op: op.to_string(),
        result_ty: result_tys.last().cloned().unwrap_or_default(),
        operands: value_names(body),
        operand_tys,
        calls: vec![],
        param: None,
    })
}

/// Operand and result types of `(a, b) -> r`, `a, b, c -> r`, `a to b`, or `a, b` (the last
/// is the result) / `t` (operands and result alike).
fn parse_sig(sig: &str) -> (Vec<String>, Vec<String>) {
    let split = find_top(sig, "->")
        .map(|p| (p, 2))
        .or_else(|| find_top(sig, " to ").map(|p| (p, 4)));
    if let Some((p, n)) = split {
        return (type_list(&sig[..p]), type_list(&sig[p + n..]));
    }
    let mut all = type_list(sig);
    if all.len() > 1 {
        let last = all.pop().unwrap_or_default();
        (all, vec![last])
    } else {
        (all.clone(), all)
    }
}

fn type_list(s: &str) -> Vec<String> {
    let s = s.trim();
    let s = if s.starts_with('(') && matching(s, 0) == Some(s.len() - 1) {
        &s[1..s.len() - 1]
    } else {
        s
    };
    split_top(s, b',')
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect()
}

struct Shaped {
    dims: Vec<i64>,
    elem: String,
    space: Option<String>,
}

/// `memref<2x128xbf16, #tpu.memory_space<vmem>>`, `tensor<...>`, `vector<...>`.
fn shaped(ty: &str) -> Option<Shaped> {
    let ty = ty.trim();
    let open = ty.find('<')?;
    if !matches!(&ty[..open], "memref" | "tensor" | "vector") {
        return None;
    }
    let close = matching(ty, open)?;
    let parts = split_top(&ty[open + 1..close], b',');
    let mut rest = parts.first()?.trim();
    let mut dims = vec![];
    while let Some(x) = rest.find('x') {
        let d = &rest[..x];
        if d == "?" {
            dims.push(-1);
        } else if !d.is_empty() && d.chars().all(|c| c.is_ascii_digit()) {
            dims.push(d.parse().unwrap_or(-1));
        } else {
            break;
        }
        rest = &rest[x + 1..];
    }
    Some(Shaped {
        dims,
        elem: rest.to_string(),
        space: parts[1..].iter().find_map(|p| memory_space_in(p)),
    })
}

/// `#tpu.memory_space<vmem>`, `memory_space = vmem`, `mhlo.memory_kind = "pinned_host"`.
fn memory_space_in(s: &str) -> Option<String> {
    if let Some(a) = s.find("memory_space<") {
        let v = &s[a + "memory_space<".len()..];
        return v.find('>').map(|e| v[..e].trim().to_string());
    }
    for key in ["memory_space", "memory_kind"] {
        if let Some(a) = s.find(key) {
            let v = s[a + key.len()..]
                .trim_start()
                .strip_prefix('=')?
                .trim_start();
            let v: String = v
                .trim_start_matches(['"', '#'])
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            return (!v.is_empty()).then_some(v);
        }
    }
    None
}

/// The first value inside `key(...)`, e.g. `target_semaphore(%2 : ...)` -> `2`.
fn named_value(text: &str, key: &str) -> Option<String> {
    let pat = format!("{key}(");
    let mut from = 0;
    while let Some(at) = text[from..].find(&pat).map(|a| a + from) {
        from = at + pat.len();
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        if text[..at].chars().next_back().is_some_and(ident) {
            continue;
        }
        let close = matching(text, at + key.len()).unwrap_or(text.len());
        if let Some(v) = value_names(&text[at + pat.len()..close]).into_iter().next() {
            return Some(v);
        }
    }
    None
}

fn custom_call_target(line: &str) -> String {
    for key in ["custom_call_target=\"", "call_target_name = \""] {
        if let Some(a) = line.find(key) {
            let v = &line[a + key.len()..];
            return v[..v.find('"').unwrap_or(v.len())].to_string();
        }
    }
    line.find("custom_call @")
        .map(|a| {
            line[a + "custom_call @".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '.')
                .collect()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Types
// ---------------------------------------------------------------------------------------------

/// The element type of an MLIR shaped type, an HLO array (a tuple's first element), or a
/// scalar type as written.
fn elem_type(ty: &str) -> String {
    if let Some(s) = shaped(ty) {
        return s.elem;
    }
    let ty = ty.trim();
    if ty.starts_with('(') || ty.contains('[') {
        return hlo_arrays(ty)
            .into_iter()
            .next()
            .map(|a| a.elem)
            .unwrap_or_default();
    }
    ty.to_string()
}

fn is_fp8(elem: &str) -> bool {
    let b = elem.as_bytes();
    b.len() >= 5 && b[..3].eq_ignore_ascii_case(b"f8e")
}

fn is_wide_float(elem: &str) -> bool {
    matches!(elem, "f16" | "bf16" | "f32" | "f64")
}

fn is_int8(elem: &str) -> bool {
    matches!(elem, "u8" | "s8" | "i8" | "ui8" | "si8")
}

/// fp8 type names in a line: `f8e4m3fn[`, `xf8E4M3FN>`, `<f8E5M2>`, not `%f8e_name`.
fn fp8_types_in(line: &str) -> Vec<String> {
    let b = line.as_bytes();
    let mut out = vec![];
    let mut i = 0;
    while i + 3 <= b.len() {
        if !b[i..i + 3].eq_ignore_ascii_case(b"f8e") {
            i += 1;
            continue;
        }
        let shape_x = i >= 2 && b[i - 1] == b'x' && (b[i - 2].is_ascii_digit() || b[i - 2] == b'?');
        let glued = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b"_%.-$@".contains(&b[i - 1]));
        let end = i + b[i..]
            .iter()
            .take_while(|c| c.is_ascii_alphanumeric())
            .count();
        let tail_ok = end == b.len() || !b"_.-".contains(&b[end]);
        if (shape_x || !glued) && tail_ok && end - i >= 5 {
            out.push(line[i..end].to_string());
        }
        i = end.max(i + 1);
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Space {
    HbmOrAny,
    Vmem,
    Smem,
    Other,
    Unknown,
}

/// On TPU, HLO memory space 0 is HBM and 1 (the alternate memory) is VMEM.
fn space_class(s: &str) -> Space {
    match s.to_ascii_lowercase().as_str() {
        "any" | "hbm" | "s(0)" => Space::HbmOrAny,
        "vmem" | "s(1)" => Space::Vmem,
        "smem" => Space::Smem,
        _ => Space::Other,
    }
}

fn space_label(s: Option<&str>) -> String {
    match s {
        Some("S(0)") => "S(0) (device memory, HBM)".to_string(),
        Some("S(1)") => "S(1) (alternate memory, VMEM on TPU)".to_string(),
        Some("S(5)") => "S(5) (host memory)".to_string(),
        Some(s) => s.to_string(),
        None => "(default)".to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Text scanning: brackets, strings, comments
// ---------------------------------------------------------------------------------------------

/// Calls `f(index, byte, depth)` for each byte outside string literals, `depth` counting the
/// brackets `( [ { <` open around it (a closing bracket is reported at the outer depth);
/// stops when `f` returns false. The `>` of `->` and the `<` of `<=` are not brackets.
/// Returns the depth at the end.
fn walk(s: &str, mut f: impl FnMut(usize, u8, i32) -> bool) -> i32 {
    let b = s.as_bytes();
    let mut depth = 0i32;
    let mut in_str = false;
    let mut escaped = false;
    for (i, &c) in b.iter().enumerate() {
        if in_str {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_str = false;
            }
            continue;
        }
        let arrow = c == b'>' && i > 0 && b[i - 1] == b'-';
        let le = c == b'<' && b.get(i + 1) == Some(&b'=');
        if c == b'"' {
            in_str = true;
            continue;
        }
        if matches!(c, b')' | b']' | b'}') || (c == b'>' && !arrow) {
            depth -= 1;
        }
        if !f(i, c, depth) {
            return depth;
        }
        if matches!(c, b'(' | b'[' | b'{') || (c == b'<' && !le) {
            depth += 1;
        }
    }
    depth
}

fn depth(s: &str) -> i32 {
    walk(s, |_, _, _| true)
}

/// Index of the bracket closing the one at `open`.
fn matching(s: &str, open: usize) -> Option<usize> {
    let tail = s.get(open..)?;
    let mut found = None;
    walk(tail, |i, c, d| {
        if i > 0 && d == 0 && matches!(c, b')' | b']' | b'}' | b'>') {
            found = Some(open + i);
            return false;
        }
        d >= 0
    });
    found
}

/// First occurrence of `pat` outside brackets and strings.
fn find_top(s: &str, pat: &str) -> Option<usize> {
    let (b, p) = (s.as_bytes(), pat.as_bytes());
    let mut found = None;
    walk(s, |i, _, d| {
        if d == 0 && b[i..].starts_with(p) {
            found = Some(i);
            return false;
        }
        true
    });
    found
}

/// Splits at `sep` outside brackets and strings.
fn split_top(s: &str, sep: u8) -> Vec<&str> {
    let mut out = vec![];
    let mut from = 0;
    walk(s, |i, c, d| {
        if c == sep && d == 0 {
            out.push(&s[from..i]);
            from = i + 1;
        }
        true
    });
    out.push(&s[from..]);
    out
}

/// `%name` values in `s` (outside strings), without `%` and any `#n` result index.
fn value_names(s: &str) -> Vec<String> {
    let b = s.as_bytes();
    let mut out = vec![];
    walk(s, |i, c, _| {
        if c == b'%' {
            let name: String = s[i + 1..]
                .chars()
                .take_while(|&c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | '$'))
                .collect();
            if !name.is_empty() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) {
                out.push(name);
            }
        }
        true
    });
    out
}

/// The line without `// ...` and `/* ... */` comments (outside strings).
fn strip_comments(line: &str) -> String {
    if !line.contains('/') {
        return line.to_string();
    }
    let b = line.as_bytes();
    let mut out = String::with_capacity(line.len());
    let (mut i, mut from, mut in_str, mut escaped) = (0, 0, false, false);
    while i < b.len() {
        let c = b[i];
        if in_str {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_str = false;
            }
        } else if c == b'"' {
            in_str = true;
        } else if c == b'/' && b.get(i + 1) == Some(&b'/') {
            out.push_str(&line[from..i]);
            return out;
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            out.push_str(&line[from..i]);
            let end = line[i + 2..].find("*/").map_or(b.len(), |e| i + 2 + e + 2);
            i = end;
            from = end;
            continue;
        }
        i += 1;
    }
    out.push_str(&line[from.min(line.len())..]);
    out
}
