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
//! use fp8nsa_inspect::{inspect, ProgramFormat, Variant};
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

mod facts;
mod hlo;
mod mlir;
mod program;
mod text;

use hlo::parse_hlo_inst;
use program::Program;
use text::{is_fp8, space_class, space_label, strip_comments, Space};

use std::fmt;
use std::str::FromStr;

/// Evidence text is cut to this many characters.
const EVIDENCE_CHARS: usize = 160;
/// At most this many evidence lines per check (the detail gives the full count).
const MAX_EVIDENCE: usize = 8;
/// Instructions visited per dot while looking for an upcast: enough to cross fusions and
/// views, small enough that a huge program stays linear.
const TRACE_LIMIT: usize = 256;
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
