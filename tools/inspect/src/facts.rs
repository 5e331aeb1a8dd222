//! The facts read from instructions: dots and what feeds them, async copies and DMAs, buffers.

use std::collections::HashSet;

use super::{first_distinct, Buffer, Check, ProgramFormat, ASYNC, DOT, FP8, MAX_EVIDENCE};
use crate::mlir::{custom_call_target, named_value};
use crate::program::{Inst, Program};
use crate::text::{elem_type, fp8_types_in, is_fp8, is_int8, is_wide_float};

pub(crate) struct DotFact {
    pub(crate) check: Check,
    pub(crate) total: usize,
    pub(crate) native: usize,
    pub(crate) upcast: usize,
}

pub(crate) struct AsyncFact {
    pub(crate) check: Check,
    pub(crate) starts: Vec<(usize, String)>,
    pub(crate) dones: usize,
    pub(crate) balanced: bool,
}

/// What a DMA start or wait names: its semaphore and its destination buffer (roots).
type DmaKey = (Option<String>, Option<String>);

impl Program<'_> {
    pub(crate) fn fp8_fact(&self, buffers: &[Buffer]) -> (Check, Vec<String>) {
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

    pub(crate) fn dot_fact(&self) -> DotFact {
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

    pub(crate) fn async_fact(&self, buffers: &[Buffer]) -> AsyncFact {
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
