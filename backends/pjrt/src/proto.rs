//! Just enough protobuf: encoding the `xla.CompileOptionsProto` every compile needs, and
//! decoding the optimized `HloModuleProtoWithConfig` a compiled executable reports into
//! HLO-like text (for `fp8nsa inspect`).
// ---- encoding -------------------------------------------------------------
fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}
fn put_tag(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire));
}
/// int64 / bool / enum field (wire type 0). Negative int64 => 10 bytes.
pub fn put_int(out: &mut Vec<u8>, field: u32, v: i64) {
    put_tag(out, field, 0);
    put_varint(out, v as u64);
}
/// bytes / string / sub-message field (wire type 2).
pub fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_tag(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// xla.CompileOptionsProto {
///   executable_build_options (3): ExecutableBuildOptionsProto {
///     device_ordinal (1), num_replicas (4), num_partitions (5) } }
pub fn compile_options(device_ordinal: i64, num_replicas: i64, num_partitions: i64) -> Vec<u8> {
    let mut ebo = Vec::new();
    put_int(&mut ebo, 1, device_ordinal);
    put_int(&mut ebo, 4, num_replicas);
    put_int(&mut ebo, 5, num_partitions);
    let mut out = Vec::new();
    put_bytes(&mut out, 3, &ebo);
    out
}

/// xla.CompileOptionsProto for one replica split SPMD-style into `device_ids.len()`
/// partitions, partition `i` on device `device_ids[i]`:
/// `executable_build_options (3): ExecutableBuildOptionsProto { device_ordinal (1) = -1,
/// num_replicas (4) = 1, num_partitions (5), use_spmd_partitioning (6) = true,
/// device_assignment (9): DeviceAssignmentProto { replica_count (1) = 1,
/// computation_count (2), computation_devices (3) [{ replica_device_ids (1) }] } }`.
/// The assignment is explicit so that the order of `execute_sharded`'s argument lists (the
/// executable's addressable devices) is the order given here, not the plugin's default.
pub fn spmd_compile_options(device_ids: &[i64]) -> Vec<u8> {
    let mut da = Vec::new();
    put_int(&mut da, 1, 1);
    put_int(&mut da, 2, device_ids.len() as i64);
    for &id in device_ids {
        let mut cd = Vec::new();
        put_int(&mut cd, 1, id);
        put_bytes(&mut da, 3, &cd);
    }
    let mut ebo = Vec::new();
    // -1: no single device; the assignment below places the partitions
    put_int(&mut ebo, 1, -1);
    put_int(&mut ebo, 4, 1);
    put_int(&mut ebo, 5, device_ids.len() as i64);
    put_int(&mut ebo, 6, 1);
    put_bytes(&mut ebo, 9, &da);
    let mut out = Vec::new();
    put_bytes(&mut out, 3, &ebo);
    out
}

// ---- decoding -------------------------------------------------------------
#[derive(Clone, Copy, Debug)]
#[allow(dead_code)] // Fixed64 payloads are skipped, never read
pub enum Val<'a> {
    Int(u64),
    Fixed64(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
}

fn get_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*pos)?;
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Splits one message into (field number, value) pairs; None if malformed.
pub fn fields(buf: &[u8]) -> Option<Vec<(u32, Val<'_>)>> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < buf.len() {
        let tag = get_varint(buf, &mut pos)?;
        let field = u32::try_from(tag >> 3).ok()?;
        let val = match tag & 7 {
            0 => Val::Int(get_varint(buf, &mut pos)?),
            1 => {
                let b = buf.get(pos..pos + 8)?;
                pos += 8;
                Val::Fixed64(u64::from_le_bytes(b.try_into().ok()?))
            }
            2 => {
                let len = usize::try_from(get_varint(buf, &mut pos)?).ok()?;
                let b = buf.get(pos..pos.checked_add(len)?)?;
                pos += len;
                Val::Bytes(b)
            }
            5 => {
                let b = buf.get(pos..pos + 4)?;
                pos += 4;
                Val::Fixed32(u32::from_le_bytes(b.try_into().ok()?))
            }
            _ => return None,
        };
        out.push((field, val));
    }
    Some(out)
}

pub struct Msg<'a>(pub Vec<(u32, Val<'a>)>);
impl<'a> Msg<'a> {
    pub fn parse(buf: &'a [u8]) -> Msg<'a> {
        Msg(fields(buf).unwrap_or_default())
    }
    pub fn int(&self, f: u32) -> Option<i64> {
        self.0.iter().rev().find_map(|(n, v)| match v {
            Val::Int(x) if *n == f => Some(*x as i64),
            _ => None,
        })
    }
    pub fn bytes(&self, f: u32) -> Option<&'a [u8]> {
        self.0.iter().rev().find_map(|(n, v)| match v {
            Val::Bytes(b) if *n == f => Some(*b),
            _ => None,
        })
    }
    pub fn str(&self, f: u32) -> String {
        self.bytes(f)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    }
    pub fn all_bytes(&self, f: u32) -> Vec<&'a [u8]> {
        self.0
            .iter()
            .filter_map(|(n, v)| match v {
                Val::Bytes(b) if *n == f => Some(*b),
                _ => None,
            })
            .collect()
    }
    /// repeated int64, packed or not.
    pub fn ints(&self, f: u32) -> Vec<i64> {
        let mut out = Vec::new();
        for (n, v) in &self.0 {
            if *n != f {
                continue;
            }
            match v {
                Val::Int(x) => out.push(*x as i64),
                Val::Bytes(b) => {
                    let mut p = 0;
                    while p < b.len() {
                        match get_varint(b, &mut p) {
                            Some(x) => out.push(x as i64),
                            None => break,
                        }
                    }
                }
                _ => {}
            }
        }
        out
    }
    /// repeated float (packed fixed32 or not).
    pub fn floats(&self, f: u32) -> Vec<f32> {
        let mut out = Vec::new();
        for (n, v) in &self.0 {
            if *n != f {
                continue;
            }
            match v {
                Val::Fixed32(x) => out.push(f32::from_bits(*x)),
                Val::Bytes(b) => out.extend(
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                ),
                _ => {}
            }
        }
        out
    }
}

// ---- HLO rendering ---------------------------------------------------------
// xla.PrimitiveType numbers (xla_data.proto) -- NOT the PJRT_Buffer_Type numbers.
fn prim_name(t: i64) -> String {
    match t {
        1 => "pred",
        2 => "s8",
        3 => "s16",
        4 => "s32",
        5 => "s64",
        6 => "u8",
        7 => "u16",
        8 => "u32",
        9 => "u64",
        10 => "f16",
        11 => "f32",
        12 => "f64",
        13 => "tuple",
        14 => "opaque",
        15 => "c64",
        16 => "bf16",
        17 => "token",
        18 => "c128",
        19 => "f8e5m2",
        20 => "f8e4m3fn",
        21 => "s4",
        22 => "u4",
        23 => "f8e4m3b11fnuz",
        24 => "f8e5m2fnuz",
        25 => "f8e4m3fnuz",
        28 => "f8e4m3",
        other => return format!("type{other}"),
    }
    .to_string()
}

/// ShapeProto: element_type 2, dimensions 3, tuple_shapes 4, layout 5
/// (LayoutProto.minor_to_major 1).
fn shape_str(buf: &[u8]) -> String {
    let m = Msg::parse(buf);
    let ty = m.int(2).unwrap_or(0);
    if ty == 13 {
        let parts: Vec<String> = m.all_bytes(4).iter().map(|b| shape_str(b)).collect();
        return format!("({})", parts.join(", "));
    }
    let dims: Vec<String> = m.ints(3).iter().map(|d| d.to_string()).collect();
    let mut s = format!("{}[{}]", prim_name(ty), dims.join(","));
    if let Some(l) = m.bytes(5).filter(|_| !dims.is_empty()) {
        let mtm: Vec<String> = Msg::parse(l)
            .ints(1)
            .iter()
            .map(|d| d.to_string())
            .collect();
        s.push_str(&format!("{{{}}}", mtm.join(",")));
    }
    s
}

fn list(v: &[i64]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Renders HloModuleProtoWithConfig (hlo_module = 1) or a bare
/// HloModuleProto as HLO-like text. This is a reconstruction from the
/// proto fields, close to (but not byte-identical with) XLA's printer.
pub fn render_hlo(buf: &[u8], format: &str) -> Vec<String> {
    let module_bytes = if format == "hlo_with_config" {
        Msg::parse(buf).bytes(1).unwrap_or(&[])
    } else {
        buf
    };
    let module = Msg::parse(module_bytes);
    let mut lines = vec![format!(
        "HloModule {}, entry_computation={}",
        module.str(1),
        module.str(2)
    )];
    // HloModuleProto.computations = 3; HloComputationProto: name 1,
    // instructions 2, id 5, root_id 6.
    let comps: Vec<Msg> = module.all_bytes(3).into_iter().map(Msg::parse).collect();
    let comp_name = |id: i64| -> String {
        comps
            .iter()
            .find(|c| c.int(5).unwrap_or(0) == id)
            .map(|c| c.str(1))
            .unwrap_or_else(|| format!("comp{id}"))
    };
    let entry = module.str(2);
    for c in &comps {
        let cname = c.str(1);
        lines.push(String::new());
        lines.push(format!(
            "{}%{} {{",
            if cname == entry { "ENTRY " } else { "" },
            cname
        ));
        let insts: Vec<Msg> = c.all_bytes(2).into_iter().map(Msg::parse).collect();
        let root = c.int(6).unwrap_or(-1);
        let inst_name = |id: i64| -> String {
            insts
                .iter()
                .find(|i| i.int(35).unwrap_or(0) == id)
                .map(|i| i.str(1))
                .unwrap_or_else(|| format!("inst{id}"))
        };
        for i in &insts {
            // HloInstructionProto: name 1, opcode 2, shape 3, literal 8,
            // parameter_number 9, fusion_kind 11, dimensions 14,
            // custom_call_target 28, dot_dimension_numbers 30, id 35,
            // operand_ids 36, called_computation_ids 38.
            let opcode = i.str(2);
            let id = i.int(35).unwrap_or(0);
            let operands: Vec<String> = if opcode == "parameter" {
                vec![i.int(9).unwrap_or(0).to_string()]
            } else if opcode == "constant" {
                let lit = Msg::parse(i.bytes(8).unwrap_or(&[]));
                let f = lit.floats(8); // LiteralProto.f32s = 8
                vec![if f.is_empty() {
                    "...".into()
                } else {
                    format!("{f:?}")
                }]
            } else {
                i.ints(36)
                    .iter()
                    .map(|&o| format!("%{}", inst_name(o)))
                    .collect()
            };
            let mut attrs = Vec::new();
            let dims = i.ints(14);
            if !dims.is_empty() {
                attrs.push(format!("dimensions={{{}}}", list(&dims)));
            }
            if let Some(d) = i.bytes(30) {
                let d = Msg::parse(d);
                attrs.push(format!(
                    "lhs_batch_dims={{{}}}, lhs_contracting_dims={{{}}}, rhs_batch_dims={{{}}}, rhs_contracting_dims={{{}}}",
                    list(&d.ints(3)), list(&d.ints(1)), list(&d.ints(4)), list(&d.ints(2))
                ));
            }
            let kind = i.str(11);
            if !kind.is_empty() {
                attrs.push(format!("kind={kind}"));
            }
            let called: Vec<String> = i
                .ints(38)
                .iter()
                .map(|&c| format!("%{}", comp_name(c)))
                .collect();
            if !called.is_empty() {
                attrs.push(format!("calls={}", called.join(",")));
            }
            let target = i.str(28);
            if !target.is_empty() {
                attrs.push(format!("custom_call_target=\"{target}\""));
            }
            let mut line = format!(
                "  {}%{} = {} {}({})",
                if id == root { "ROOT " } else { "" },
                i.str(1),
                shape_str(i.bytes(3).unwrap_or(&[])),
                opcode,
                operands.join(", ")
            );
            for a in attrs {
                line.push_str(", ");
                line.push_str(&a);
            }
            lines.push(line);
        }
        lines.push("}".into());
    }
    lines
}
