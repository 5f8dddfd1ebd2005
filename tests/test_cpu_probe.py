"""kernels/cpu_probe.py: the tier a CPU's flags give, a cap that lowers it (never raises it), the flags and
compiler targets a capped process uses, and the kernels it builds for that tier."""

import subprocess
import sys

import pytest
from tokenmill.kernels import cpu_probe
from tokenmill.kernels.cpu_probe import TIER_FLAGS, TIERS, caps_for, tier_of


def _flags_of(tier: str) -> frozenset[str]:
    """A CPU with exactly the flags up to `tier` (and one unrelated flag)."""
    return frozenset({"sse4_2"}).union(*(TIER_FLAGS[t] for t in TIERS[: TIERS.index(tier) + 1]))


@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_is_what_its_flags_give(tier) -> None:
    assert tier_of(_flags_of(tier)) == tier


def test_a_missing_flag_drops_to_the_tier_below() -> None:
    # AVX-512 BF16 without avx512dq is not the avx512 level: the AVX2 kernels are what can run
    flags = _flags_of("avx512_bf16") - {"avx512dq"}
    assert tier_of(flags) == "avx2"
    assert tier_of(_flags_of("amx") - {"amx_bf16"}) == "avx512_bf16"


def test_a_cap_lowers_the_tier_and_hides_the_flags_above_it() -> None:
    caps = caps_for(_flags_of("amx"), "avx2")
    assert (caps.machine_tier, caps.tier, caps.capped) == ("amx", "avx2", True)
    assert "avx2" in caps.flags and "sse4_2" in caps.flags
    assert not caps.flags & (TIER_FLAGS["avx512"] | TIER_FLAGS["avx512_bf16"] | TIER_FLAGS["amx"])
    assert caps.at_least("avx2") and not caps.at_least("avx512")
    assert caps.march()[0] == "-march=x86-64-v3"  # built for the level, not this CPU
    uncapped = caps_for(_flags_of("amx"), None)
    assert not uncapped.capped and uncapped.march() == ["-march=native"]


def test_a_cap_above_the_machine_or_an_unknown_tier_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="TOKENMILL_CPU_TIER=amx is above this CPU's tier avx2"):
        caps_for(_flags_of("avx2"), "amx")
    with pytest.raises(ValueError, match=r"unknown CPU tier 'avx3'; tiers, lowest first: generic, avx2"):
        caps_for(_flags_of("avx2"), "avx3")


def test_the_command_line_prints_this_machines_lower_tiers_and_a_tiers_environment(capsys) -> None:
    machine = tier_of(cpu_probe.read_cpu_flags())
    # The Makefile runs it as a module: once for real, the other answers through main() in this process
    run = [sys.executable, "-m", "tokenmill.kernels.cpu_probe", "--lower"]
    lower = subprocess.run(run, capture_output=True, text=True, check=True)
    assert lower.stdout.split() == list(TIERS[: TIERS.index(machine)]) and not lower.stderr
    assert cpu_probe.main(["--env", "generic"]) == 0
    env = capsys.readouterr().out.split()
    assert "TOKENMILL_CPU_TIER=generic" in env and "ATEN_CPU_CAPABILITY=default" in env
    if machine != "amx":
        assert cpu_probe.main(["--env", "amx"]) == 2
        assert f"above this CPU's tier {machine}" in capsys.readouterr().err


def test_this_process_runs_at_the_probes_tier() -> None:
    """Under a cap (make test's lower-tier runs) the probe reports it and torch's ISA limits are set."""
    import os

    caps = cpu_probe.probe()
    assert caps.machine_tier == tier_of(cpu_probe.read_cpu_flags())
    if os.environ.get("TOKENMILL_CPU_TIER"):
        assert caps.tier == os.environ["TOKENMILL_CPU_TIER"] and caps.capped == (caps.tier != caps.machine_tier)
        for key, value in cpu_probe.TIER_TORCH_ENV[caps.tier].items():
            assert os.environ[key] == value
    else:
        assert not caps.capped


def test_the_kernels_built_for_the_tier_offer_only_its_paths() -> None:
    """The compiled kernels' own checks (the C++ preprocessor's view of -march) agree with the probe."""
    from tokenmill.kernels import cpu

    ops = cpu.load()
    if ops is None:
        pytest.skip(f"the C++ kernels did not build: {cpu.unavailable_reason()}")
    caps = cpu_probe.probe()
    assert bool(ops.packed_linear_supported()) == caps.at_least("avx2")
    assert bool(ops.linear_codes_bf16_supported()) == caps.at_least("avx512_bf16")
    if not caps.at_least("amx"):
        assert not ops.linear_codes_amx_supported()
