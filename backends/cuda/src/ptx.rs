//! The PTX built by `build.rs`, one text per kernel file and target family.

include!(concat!(env!("OUT_DIR"), "/ptx.rs"));

/// A PTX target family. The newest one a device supports is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// Ampere (compute capability 8.0 - 8.8): no fp8 tensor cores.
    Sm80,
    /// Ada, Hopper and later (8.9+): fp8 `mma.sync`.
    Sm89,
}

impl Family {
    /// The family for compute capability `(major, minor)`, `None` below 8.0.
    pub fn for_capability(cc: (i32, i32)) -> Option<Family> {
        match cc {
            (major, _) if major < 8 => None,
            (8, minor) if minor < 9 => Some(Family::Sm80),
            _ => Some(Family::Sm89),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Family::Sm80 => "sm80",
            Family::Sm89 => "sm89",
        }
    }
}

/// The PTX of `module` for `family`, if that module is built for it.
pub(crate) fn find(module: &str, family: Family) -> Option<&'static str> {
    MODULES
        .iter()
        .find(|(m, f, _)| *m == module && *f == family.name())
        .map(|(_, _, ptx)| *ptx)
}

/// `.entry` names declared in a PTX text.
pub fn entries(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .map(|l| l.split('(').next().unwrap_or(l).trim())
        .collect()
}

/// Every (module, family, entry names) built into this crate.
pub fn built_modules() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
    MODULES
        .iter()
        .map(|(m, f, ptx)| (*m, *f, entries(ptx)))
        .collect()
}
