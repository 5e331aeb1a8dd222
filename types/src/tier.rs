//! The CPU's SIMD tier: detected once per process, capped only by tests.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// The instruction-set tier the CPU kernels run at: the best this CPU has, unless capped.
/// `fp8nsa-cpu` enters a tier's `unsafe` SIMD code only at or below [`Tier::detected`].
///
/// ```
/// use fp8nsa_types::Tier;
/// assert!(Tier::current() <= Tier::detected());
/// assert_eq!(Tier::available()[0], Tier::Portable);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Plain loops (any CPU; LLVM vectorizes them for SSE2).
    Portable,
    /// AVX2 + FMA + F16C: the plain loops compiled for it, and the explicit e4m3 kernels.
    Avx2,
    /// AVX-512 F / BW / VL on top of the AVX2 tier: the plain loops compiled for it, and the
    /// explicit e4m3 kernels on 16-lane vectors.
    Avx512,
    /// AVX-512 with BF16 and VBMI (Zen 4, Sapphire Rapids) on top of the AVX-512 tier: the W8A8
    /// decode GEMV multiplies bf16 pairs (`vdpbf16ps`), which hold e4m3 values exactly.
    Avx512Bf16,
}

static CAP: AtomicU8 = AtomicU8::new(Tier::Avx512Bf16 as u8);

impl Tier {
    /// The best tier this CPU has (detected once).
    pub fn detected() -> Tier {
        static DETECTED: OnceLock<Tier> = OnceLock::new();
        *DETECTED.get_or_init(detect)
    }

    /// The tier the kernels run at now: [`Tier::detected`], capped by [`Tier::cap`].
    #[inline]
    pub fn current() -> Tier {
        let cap = match CAP.load(Ordering::Relaxed) {
            0 => Tier::Portable,
            1 => Tier::Avx2,
            2 => Tier::Avx512,
            _ => Tier::Avx512Bf16,
        };
        cap.min(Self::detected())
    }

    /// Caps the tier for the whole process and returns the tier now in force. Tests use it to
    /// run every tier the machine has against the reference; a server has no reason to.
    pub fn cap(tier: Tier) -> Tier {
        CAP.store(tier as u8, Ordering::Relaxed);
        Self::current()
    }

    /// The tiers this machine can run, lowest first.
    pub fn available() -> Vec<Tier> {
        [Tier::Portable, Tier::Avx2, Tier::Avx512, Tier::Avx512Bf16]
            .into_iter()
            .filter(|t| *t <= Self::detected())
            .collect()
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Tier {
    use std::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
    if avx512 && has!("avx512vbmi") && has!("avx512bf16") {
        Tier::Avx512Bf16
    } else if avx512 {
        Tier::Avx512
    } else if avx2 {
        Tier::Avx2
    } else {
        Tier::Portable
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Tier {
    Tier::Portable
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Portable => "portable",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Avx512Bf16 => "avx512bf16",
        }
    }
}
