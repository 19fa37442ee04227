"""What the benchmarks record about the machine they ran on."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """`lscpu`'s model name and the vector/matrix ISA flags that pick kernels (avx2, avx512*, amx*)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor() or "?"
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    isa = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni")]
    return f"{model} ({', '.join(sorted(set(isa))) or 'no avx2'})"


def cpu_details() -> dict[str, object]:
    """`lscpu`'s model name, family/model/stepping, and the SIMD/matrix flags the engines pick
    kernels by (avx, avx2, fma, f16c, avx_vnni, avx512*, amx*)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {"model_name": platform.processor() or "?"}
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    simd = ("avx", "avx2", "fma", "f16c", "avx_vnni")
    flags = [f for f in fields.get("Flags", "").split() if f in simd or f.startswith(("avx512", "amx"))]
    return {"model_name": fields.get("Model name", "?"), "family": fields.get("CPU family"),
            "model": fields.get("Model"), "stepping": fields.get("Stepping"), "flags": flags}
