"""The machine gpu-run says it found: a CPU with AVX512-BF16 or AMX is bf16-capable (quality.yaml
in about an hour), one with AVX2 only is not (4-5 hours); read from /proc/cpuinfo's flags."""

from __future__ import annotations

from embedpipe_tools.gpurun.machine import describe

CPUINFO = "processor\t: 0\nvendor_id\t: X\nmodel name\t: {model}\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n"


def test_a_cpu_with_avx512_bf16_or_amx_is_bf16_capable_and_an_avx2_only_one_is_not(tmp_path):
    cases = {"avx512": ("avx2 avx512f avx512_bf16", "bf16"), "amx": ("avx2 amx_tile amx_bf16", "bf16"),
             "avx2": ("avx2 fma", "avx2"), "old": ("sse4_2", "other")}
    for name, (flags, kind) in cases.items():
        (tmp_path / name).write_text(CPUINFO.format(model="Test CPU 9000", flags=flags))
        found = describe(cuda=False, cpuinfo=tmp_path / name)
        assert found["kind"] == kind, flags
        assert found["cpu"] == "Test CPU 9000" and found["device"] == "CPU: Test CPU 9000"
    bf16 = describe(cuda=False, cpuinfo=tmp_path / "avx512")
    assert bf16["cpu_bf16_flags"] == ["avx512_bf16"] and "about an hour" in bf16["verdict"]
    assert describe(cuda=False, cpuinfo=tmp_path / "amx")["cpu_bf16_flags"] == ["amx_bf16", "amx_tile"]
    avx2 = describe(cuda=False, cpuinfo=tmp_path / "avx2")
    assert avx2["cpu_bf16_flags"] == [] and "AVX2-only" in avx2["verdict"]


def test_an_unreadable_cpuinfo_still_describes_the_machine(tmp_path):
    found = describe(cuda=False, cpuinfo=tmp_path / "missing")
    assert found["kind"] == "other" and found["cpu"] and found["verdict"]
