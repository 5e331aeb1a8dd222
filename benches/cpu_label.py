#!/usr/bin/env python3
"""The CPU label every benchmark row carries, and the slug its results file is named by.

"AMD EPYC" alone names both the AVX2-only EPYC VMs and the Zen 4 ones, whose numbers differ
by up to 2x, so the label adds the family / model and the widest SIMD level the kernels pick
(the crate's tiers: avx512bf16, avx512, avx2, portable):

    python3 benches/cpu_label.py          # AMD EPYC (family 25 model 17, avx512bf16)
    python3 benches/cpu_label.py --slug   # amd-epyc-f25m17-avx512bf16

`label()` and `slug()` are imported by compare.py and loadgen.py; run.sh calls the script.
"""

import re
import sys


def _cpuinfo() -> dict:
    info = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def _tier(flags: set) -> str:
    # the order of fp8nsa_cpu's Tier::detected(): the first level whose features are all there
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl"} <= flags
    if avx512 and {"avx512vbmi", "avx512_bf16"} <= flags:
        return "avx512bf16"
    return "avx512" if avx512 else "avx2" if avx2 else "portable"


def _parts() -> tuple:
    """Model name, "family / model" (or None), SIMD level."""
    info = _cpuinfo()
    fam, model = info.get("cpu family"), info.get("model")
    return (
        info.get("model name", "unknown"),
        (fam, model) if fam and model else None,
        _tier(set(info.get("flags", "").split())),
    )


def label() -> str:
    name, fm, tier = _parts()
    where = f"family {fm[0]} model {fm[1]}, " if fm else ""
    return f"{name} ({where}{tier})"


def slug() -> str:
    name, fm, tier = _parts()
    where = f"-f{fm[0]}m{fm[1]}" if fm else ""
    return f"{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}{where}-{tier}"


if __name__ == "__main__":
    print(slug() if "--slug" in sys.argv[1:] else label())
