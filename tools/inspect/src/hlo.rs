//! Reading XLA HLO text.

use std::collections::HashMap;

use crate::program::{Inst, Scope};
use crate::text::{matching, split_top};

pub(crate) struct HloLine<'s> {
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
pub(crate) fn parse_hlo_inst(line: &str) -> Option<HloLine<'_>> {
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

pub(crate) fn parse_hlo(code: &[String]) -> (Vec<Inst>, Vec<Scope>) {
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

pub(crate) struct HloArray {
    pub(crate) dims: Vec<i64>,
    pub(crate) elem: String,
    pub(crate) space: String,
}

/// The array types of an HLO shape (a tuple's elements, flattened), with their memory space
/// (`S(n)` from the layout, `S(0)` when none is written).
pub(crate) fn hlo_arrays(ty: &str) -> Vec<HloArray> {
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
