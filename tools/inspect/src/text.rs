//! Types and text scanning: element types, memory spaces, brackets, strings, comments.

use crate::hlo::hlo_arrays;
use crate::mlir::shaped;

/// The element type of an MLIR shaped type, an HLO array (a tuple's first element), or a
/// scalar type as written.
pub(crate) fn elem_type(ty: &str) -> String {
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

pub(crate) fn is_fp8(elem: &str) -> bool {
    let b = elem.as_bytes();
    b.len() >= 5 && b[..3].eq_ignore_ascii_case(b"f8e")
}

pub(crate) fn is_wide_float(elem: &str) -> bool {
    matches!(elem, "f16" | "bf16" | "f32" | "f64")
}

pub(crate) fn is_int8(elem: &str) -> bool {
    matches!(elem, "u8" | "s8" | "i8" | "ui8" | "si8")
}

/// fp8 type names in a line: `f8e4m3fn[`, `xf8E4M3FN>`, `<f8E5M2>`, not `%f8e_name`.
pub(crate) fn fp8_types_in(line: &str) -> Vec<String> {
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
pub(crate) enum Space {
    HbmOrAny,
    Vmem,
    Smem,
    Other,
    Unknown,
}

/// On TPU, HLO memory space 0 is HBM and 1 (the alternate memory) is VMEM.
pub(crate) fn space_class(s: &str) -> Space {
    match s.to_ascii_lowercase().as_str() {
        "any" | "hbm" | "s(0)" => Space::HbmOrAny,
        "vmem" | "s(1)" => Space::Vmem,
        "smem" => Space::Smem,
        _ => Space::Other,
    }
}

pub(crate) fn space_label(s: Option<&str>) -> String {
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

pub(crate) fn depth(s: &str) -> i32 {
    walk(s, |_, _, _| true)
}

/// Index of the bracket closing the one at `open`.
pub(crate) fn matching(s: &str, open: usize) -> Option<usize> {
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
pub(crate) fn find_top(s: &str, pat: &str) -> Option<usize> {
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
pub(crate) fn split_top(s: &str, sep: u8) -> Vec<&str> {
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
pub(crate) fn value_names(s: &str) -> Vec<String> {
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
pub(crate) fn strip_comments(line: &str) -> String {
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
