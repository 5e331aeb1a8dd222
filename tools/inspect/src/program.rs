//! The parsed program: instructions grouped in scopes (HLO computations, MLIR functions).

use std::collections::{HashMap, HashSet, VecDeque};

use super::{evidence, Buffer, BufferRole, ProgramFormat, ROOT_STEPS, TRACE_LIMIT};
use crate::hlo::{hlo_arrays, parse_hlo};
use crate::mlir::{custom_call_target, parse_mlir, shaped};
use crate::text::{elem_type, is_fp8, is_wide_float, strip_comments};

pub(crate) struct Inst {
    /// 1-based.
    pub(crate) line: usize,
    pub(crate) scope: usize,
    /// The (first) result's name, without `%`.
    pub(crate) name: Option<String>,
    /// HLO opcode or MLIR op name (`dot`, `stablehlo.dot_general`, `tpu.enqueue_dma`).
    pub(crate) op: String,
    pub(crate) result_ty: String,
    /// Value names used, without `%`.
    pub(crate) operands: Vec<String>,
    /// Operand types written on the line (HLO inline types, the MLIR type signature).
    pub(crate) operand_tys: Vec<String>,
    /// HLO computations this instruction runs (`calls=`, `to_apply=` of a call).
    pub(crate) calls: Vec<String>,
    /// `n` of an HLO `parameter(n)`.
    pub(crate) param: Option<usize>,
}

pub(crate) struct Arg {
    pub(crate) name: String,
    pub(crate) ty: String,
    /// A memory space given as an argument attribute rather than in the type.
    pub(crate) space_attr: Option<String>,
    pub(crate) line: usize,
    pub(crate) fragment: String,
}

pub(crate) struct Scope {
    pub(crate) name: String,
    /// HLO ENTRY computation, or the MLIR kernel / main function.
    pub(crate) entry: bool,
    pub(crate) args: Vec<Arg>,
    /// Text after the argument list (results, `attributes {...}`).
    pub(crate) attrs: String,
    pub(crate) root: Option<usize>,
}

impl Scope {
    pub(crate) fn new(name: &str, entry: bool) -> Scope {
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

pub(crate) struct Program<'a> {
    pub(crate) format: ProgramFormat,
    pub(crate) raw: &'a [&'a str],
    /// The lines without comments.
    pub(crate) code: Vec<String>,
    pub(crate) insts: Vec<Inst>,
    pub(crate) scopes: Vec<Scope>,
    /// Per scope: value name -> defining instruction.
    defs: Vec<HashMap<String, usize>>,
    scope_ids: HashMap<String, usize>,
    /// Computation name -> instructions that call it.
    callers: HashMap<String, Vec<usize>>,
}

impl<'a> Program<'a> {
    pub(crate) fn parse(format: ProgramFormat, raw: &'a [&'a str]) -> Program<'a> {
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

    pub(crate) fn ev(&self, line: usize) -> (usize, String) {
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
    pub(crate) fn operand_types(&self, inst: &Inst) -> Vec<String> {
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

    pub(crate) fn fp8_operand(&self, inst: &Inst) -> Option<String> {
        self.operand_types(inst)
            .into_iter()
            .map(|t| elem_type(&t))
            .find(|e| is_fp8(e))
    }

    pub(crate) fn is_dot(&self, inst: &Inst) -> bool {
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
    pub(crate) fn upcast(&self, inst: &Inst) -> Option<String> {
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
    pub(crate) fn trace_upcast(&self, dot: usize) -> Option<Vec<usize>> {
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
    pub(crate) fn root(&self, scope: usize, name: &str) -> String {
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

    pub(crate) fn buffers(&self) -> Vec<Buffer> {
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
