//! Reading MLIR: StableHLO and Mosaic TPU.

use super::MAX_SIGNATURE_LINES;
use crate::program::{Arg, Inst, Scope};
use crate::text::{depth, find_top, matching, split_top, value_names};

fn is_func_start(t: &str) -> bool {
    t.starts_with("func.func") || t.starts_with("func ") || t.starts_with("func @")
}

pub(crate) fn parse_mlir(code: &[String]) -> (Vec<Inst>, Vec<Scope>) {
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

pub(crate) struct Shaped {
    pub(crate) dims: Vec<i64>,
    pub(crate) elem: String,
    pub(crate) space: Option<String>,
}

/// `memref<2x128xbf16, #tpu.memory_space<vmem>>`, `tensor<...>`, `vector<...>`.
pub(crate) fn shaped(ty: &str) -> Option<Shaped> {
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
pub(crate) fn named_value(text: &str, key: &str) -> Option<String> {
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

pub(crate) fn custom_call_target(line: &str) -> String {
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
