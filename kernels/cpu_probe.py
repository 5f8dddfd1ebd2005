"""The one CPU capability probe: which instruction-set tier this process may use, and how to run a lower one.

Every CPU-path decision (which C++ kernels build, which linear kernel a batch takes, whether `auto` serves
bf16) and every test that expects one asks `probe()`, never /proc/cpuinfo directly: then a test derives
its expectation from what the engine will do here, and `TOKENMILL_CPU_TIER=<tier>` caps the tier so that a
machine runs a lower tier's paths as a lower machine would (the kernels are built for that tier's
`-march`, torch's ATen kernels and oneDNN are capped to the same ISA). A cap above the machine is refused
with the machine's tier named: nothing can emulate instructions the CPU lacks.

    python -m tokenmill.kernels.cpu_probe            # this machine's tier, the effective one, the flags
    python -m tokenmill.kernels.cpu_probe --lower    # the tiers below this machine's, lowest first
    python -m tokenmill.kernels.cpu_probe --env avx2 # the environment that runs a process at that tier

It imports no torch itself, and kernels/cpu.py imports it only where it builds, so the command line above
runs as one clean module.
"""

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# Lowest to highest. Each tier needs the flags of every tier below it and its own (/proc/cpuinfo names).
TIERS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
TIER_FLAGS = {
    "generic": frozenset(),
    # The packed fp32 kernels need all three (kernels/csrc/cpu_common.h).
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    # x86-64-v4's set: what the AVX-512 kernels and oneDNN's AVX512_CORE assume.
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    # The bf16 dot kernel on integer codes (cpu_linear_bf16.cpp); also where `auto` serves bf16.
    "avx512_bf16": frozenset({"avx512_bf16"}),
    # The AMX tile kernels (cpu_linear_amx.cpp).
    "amx": frozenset({"amx_tile", "amx_bf16"}),
}
# Compiler flags for a capped build. The machine's own tier builds with -march=native (its exact CPU);
# a lower tier builds for the generic level so no instruction above it can appear.
TIER_MARCH = {
    "generic": ["-march=x86-64", "-mtune=native"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "avx512": ["-march=x86-64-v4", "-mtune=native"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mtune=native"],
    "amx": ["-march=native"],
}
# What torch's own kernels are capped to at each tier: ATen's dispatch (ATEN_CPU_CAPABILITY: default,
# avx2, avx512) and oneDNN's ISA (ONEDNN_MAX_CPU_ISA names). Both are read when torch first needs them,
# so a capped process sets them before its first op (env_for, or probe() for child processes).
TIER_TORCH_ENV = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {},
}
TIER_ENV = "TOKENMILL_CPU_TIER"


@dataclass(frozen=True)
class CpuCaps:
    machine_tier: str  # what this CPU offers
    tier: str  # what this process uses: machine_tier, or lower under TOKENMILL_CPU_TIER
    flags: frozenset[str]  # the CPU's flags without those of the tiers above `tier`

    @property
    def capped(self) -> bool:
        return self.tier != self.machine_tier

    def at_least(self, tier: str) -> bool:
        return TIERS.index(self.tier) >= TIERS.index(_check_tier(tier))

    def march(self) -> list[str]:
        """The C++ kernels' -march flags: the machine's own CPU, or the capped tier's generic level."""
        return ["-march=native"] if not self.capped else list(TIER_MARCH[self.tier])

    def describe(self) -> str:
        cap = f" (capped by {TIER_ENV}; machine: {self.machine_tier})" if self.capped else ""
        return f"cpu tier {self.tier}{cap}"


def _check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"unknown CPU tier {tier!r}; tiers, lowest first: {', '.join(TIERS)}")
    return tier


def read_cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def tier_of(flags: frozenset[str]) -> str:
    """The highest tier whose flags, and every lower tier's, are all in `flags`."""
    best = TIERS[0]
    for tier in TIERS[1:]:
        if not TIER_FLAGS[tier] <= flags:
            break
        best = tier
    return best


def caps_for(flags: frozenset[str], cap: str | None) -> CpuCaps:
    """The capabilities of a CPU with `flags` under an optional tier cap (a pure function, for tests)."""
    machine = tier_of(flags)
    tier = machine
    if cap:
        _check_tier(cap)
        if TIERS.index(cap) > TIERS.index(machine):
            raise ValueError(f"{TIER_ENV}={cap} is above this CPU's tier {machine}: a cap can only lower it")
        tier = cap
    above = frozenset().union(*(TIER_FLAGS[t] for t in TIERS[TIERS.index(tier) + 1 :]))
    return CpuCaps(machine_tier=machine, tier=tier, flags=flags - above)


def env_for(tier: str) -> dict[str, str]:
    """The environment that runs a process (and its children) at `tier`."""
    return {TIER_ENV: _check_tier(tier), **TIER_TORCH_ENV[tier]}


@functools.cache
def probe() -> CpuCaps:
    """This process's capabilities (read once). Under a cap, torch's ISA limits go into the environment
    too (where not set already), so that engine processes this one starts run at the same tier."""
    caps = caps_for(read_cpu_flags(), os.environ.get(TIER_ENV) or None)
    if caps.capped:
        for key, value in TIER_TORCH_ENV[caps.tier].items():
            os.environ.setdefault(key, value)
    return caps


def needs(tier: str) -> str:
    """A test's skip reason for a path that needs `tier`: names it and what this run has."""
    return f"needs CPU tier {_check_tier(tier)}; this run: {probe().describe()}"


def lower_tiers() -> list[str]:
    """The tiers below this machine's, lowest first: those a test run can cap to here."""
    return list(TIERS[: TIERS.index(caps_for(read_cpu_flags(), None).machine_tier)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.kernels.cpu_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--lower", action="store_true", help="print the tiers below this machine's, lowest first")
    parser.add_argument("--env", metavar="TIER", help="print the environment (KEY=VALUE ...) that runs at TIER")
    args = parser.parse_args(argv)
    try:
        if args.lower:
            print(" ".join(lower_tiers()))
        elif args.env:
            caps_for(read_cpu_flags(), args.env)  # refuses a tier above the machine's
            print(" ".join(f"{k}={v}" for k, v in env_for(args.env).items()))
        else:
            caps = probe()
            print(caps.describe())
            print("flags used:", " ".join(sorted(f for t in TIERS for f in TIER_FLAGS[t] if f in caps.flags)) or "none")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
