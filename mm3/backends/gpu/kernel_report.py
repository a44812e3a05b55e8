"""What the Triton kernels compile to for a CUDA architecture, read without a GPU.

Each kernel (`KernelSpec`: a JIT function with the argument types and specialisations it gets at
run time) is compiled with Triton's bundled compiler for `sm_<arch>`; its PTX says how the weight
is read (`weight_loads`: the share of the weight's bytes loaded by each load width, found by
following every address back to the weight's pointer arguments), and ptxas (`-v`) says how many
registers a thread takes and whether any spill to local memory; its SASS (the cubin through the
bundled `nvdisasm`) says how many instructions of each kind the k-loop spends per weight
(`instruction_mix`). The grid each kernel gets for the released decode shapes gives the waves it
fills on the architecture's reference GPU.
`python -m mm3 kernels --report` prints it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Callable

# Streaming multiprocessors of the GPU each architecture is checked for: A100 (sm_80), RTX 4090
# (sm_89), H100 / H200 (sm_90).
ARCH_SMS = {80: 108, 89: 128, 90: 132}


@dataclass(frozen=True)
class Launch:
    """One product at a released shape: the layer, weight [n, k], input rows, and the programs the
    kernel's launcher starts for it on a GPU with `sms` multiprocessors."""

    layer: str
    n: int
    k: int
    rows: int


@dataclass
class KernelSpec:
    """A kernel as it is launched: `fn` with `signature` (argument -> Triton type, "constexpr" for
    the compile-time ones in `constexprs`), the arguments specialised as multiples of 16 (pointers:
    16-byte aligned) in `aligned`, the weight's pointer arguments in `weight_args`, and
    `programs(launch, sms)`, the grid size its launcher picks for a product."""

    name: str
    family: str
    weight_type: str
    shape: str  # "decode" or "prefill"
    fn: object
    signature: dict
    constexprs: dict
    aligned: tuple
    weight_args: tuple
    programs: Callable[[Launch, int], int]
    num_warps: int = 4
    num_stages: int = 3
    fp_fusion: bool = True  # Triton's default; False where the launcher turns contraction off
    launches: list = field(default_factory=list)
    loop_weights: int = 0  # weights one thread handles in one pass of the k-loop (0: no instruction mix)
    inner_trips: int = 1  # passes of any loop nested in the k-loop per pass of it


@dataclass
class LoadFacts:
    """Global loads of a PTX function: (width in bytes, count) of those that read the weight, and of all."""

    weight: dict
    every: dict

    def weight_bytes_by_width(self) -> dict[int, float]:
        total = sum(w * n for w, n in self.weight.items())
        return {w: (w * n / total if total else 0.0) for w, n in sorted(self.weight.items())}

    def wide_share(self, at_least: int = 8) -> float:
        return sum(s for w, s in self.weight_bytes_by_width().items() if w >= at_least)


_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);\s*(?://.*)?$")
_REG = re.compile(r"%[a-z]+\d+")
_PARAM = re.compile(r"\[\s*(\w+_param_(\d+))\s*\]")
_ADDR = re.compile(r"\[\s*(%[a-z]+\d+)")


def _width(opcode: str) -> int:
    """Bytes one thread moves with a load opcode (ld.global.v4.b32 -> 16)."""
    vec = re.search(r"\.v(\d)\b", opcode)
    bits = re.findall(r"\.[bufs](\d+)\b", opcode)
    return (int(vec.group(1)) if vec else 1) * int(bits[-1]) // 8


def global_loads(ptx: str, weight_params: set[int]) -> LoadFacts:
    """The global loads of `ptx` (one kernel) by width: those whose address derives from a pointer
    parameter in `weight_params` (by index), and all of them. An address derives from a parameter
    when a chain of register operations leads from its `ld.param` to the load (registers loaded
    from memory start no chain: their values are data). Asynchronous copies to shared memory
    (`cp.async`) count as loads of their copy size."""
    lines = []
    for raw in ptx.splitlines():
        m = _INSTR.match(raw)
        if m and not raw.lstrip().startswith((".", "//", "$")):
            lines.append((m.group(1), m.group(2)))
    origin: dict[str, set[int]] = {}
    changed = True
    while changed:  # registers are reassigned in loops: propagate to a fixed point
        changed = False
        for opcode, args in lines:
            if opcode.startswith(("st.", "cp.async", "bra", "bar", "ret", "red.", "atom.")):
                continue
            regs = _REG.findall(args)
            if not regs:
                continue
            dests, sources = _operands(opcode, args, regs)
            if opcode.startswith("ld.param"):
                p = _PARAM.search(args)
                found = {int(p.group(2))} if p else set()
            elif opcode.startswith("ld."):
                continue  # a loaded value is data, not an address
            else:
                found = set().union(*(origin.get(r, set()) for r in sources)) if sources else set()
            for d in dests:
                if not found <= origin.get(d, set()):
                    origin[d] = origin.get(d, set()) | found
                    changed = True
    weight, every = {}, {}
    for opcode, args in lines:
        if opcode.startswith("ld.global"):
            width = _width(opcode)
            address = _ADDR.search(args)
        elif opcode.startswith("cp.async") and ".shared.global" in opcode:
            sizes = re.findall(r"\],\s*(0x[0-9a-f]+|\d+)", args)
            width = int(sizes[0], 0) if sizes else 0
            address = list(_ADDR.finditer(args))[1] if len(_ADDR.findall(args)) > 1 else None
        else:
            continue
        every[width] = every.get(width, 0) + 1
        if address is not None and origin.get(address.group(1), set()) & weight_params:
            weight[width] = weight.get(width, 0) + 1
    return LoadFacts(weight, every)


def _operands(opcode: str, args: str, regs: list[str]) -> tuple[list[str], list[str]]:
    """(destination registers, source registers) of one instruction: the first operand (a brace
    list for vector results) is written, the rest are read."""
    if args.lstrip().startswith("{"):
        head, _, rest = args.partition("}")
        return _REG.findall(head), _REG.findall(rest)
    return regs[:1], regs[1:]


@dataclass
class PtxasFacts:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int


def ptxas_facts(ptx: str, arch: int) -> PtxasFacts:
    """Registers and spills of the kernel in `ptx`, from the ptxas that ships with Triton (`-v`)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory(prefix="mm3-ptxas-") as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-v", f"--gpu-name={target}", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed for {target}: {out[-2000:]}")
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return PtxasFacts(int(regs.group(1)) if regs else 0, int(spills.group(2)) if spills else 0,
                      int(spills.group(3)) if spills else 0, int(spills.group(1)) if spills else 0)


_COMPILED: dict = {}  # (spec, arch) -> (ptx, shared bytes, cubin): one compilation per process


def compile_ptx(spec: KernelSpec, arch: int) -> tuple[str, int]:
    """(PTX, shared memory bytes) of `spec` for `sm_<arch>`; Triton's own cache keeps the result
    across processes (`TRITON_CACHE_DIR`)."""
    return _compiled(spec, arch)[:2]


def compile_cubin(spec: KernelSpec, arch: int) -> bytes:
    """The cubin ptxas made of `spec` for `sm_<arch>`."""
    return _compiled(spec, arch)[2]


def _compiled(spec: KernelSpec, arch: int) -> tuple[str, int, bytes]:
    key = (spec.name, arch, repr(sorted(spec.constexprs.items())), repr(sorted(spec.signature.items())),
           spec.aligned, spec.num_warps, spec.num_stages, spec.fp_fusion)
    if key not in _COMPILED:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile

        names = [a for a in spec.fn.arg_names]
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.aligned}
        source = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
        kernel = compile(source, target=GPUTarget("cuda", arch, 32),
                         options={"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                                  "enable_fp_fusion": spec.fp_fusion})
        _COMPILED[key] = (kernel.asm["ptx"], int(kernel.metadata.shared), kernel.asm["cubin"])
    return _COMPILED[key]


def sass(cubin: bytes) -> str:
    """The SASS of a cubin, from the `nvdisasm` that ships with Triton."""
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="mm3-sass-") as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", path], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {done.stderr[-2000:]}")
    return done.stdout


KINDS = ("integer", "float", "memory", "other")
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L\w+):")
_TARGET = re.compile(r"`\((\.L\w+)\)")
_MEMORY = ("LD", "ST", "ATOM", "RED", "ULDC", "LDC", "CCTL", "MEMBAR", "UBLKCP", "UTMA")
_FLOAT = ("F", "H", "DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "MUFU", "I2F", "F2I")
_INTEGER = ("I", "LOP", "SHF", "SHL", "SHR", "LEA", "PRMT", "SEL", "BMSK", "SGXT", "POPC", "FLO", "BREV", "VIADD",
            "VIMNMX", "IDP", "BFE", "BFI")


def kind_of(opcode: str) -> str:
    """"integer", "float" (conversions to or from floats included), "memory" (global, shared,
    local and constant loads and stores, atomics) or "other" (moves, predicates, branches,
    special registers) for a SASS opcode; uniform-datapath opcodes (U...) count as their kind."""
    base = opcode[1:] if opcode.startswith("U") and opcode not in ("UMOV",) else opcode
    if opcode.startswith(_MEMORY) or base.startswith(_MEMORY):
        return "memory"
    if base.startswith(_FLOAT) and not base.startswith(("FLO", "FENCE")):
        return "float"
    if base.startswith(_INTEGER) and not base.startswith("SHFL"):
        return "integer"
    return "other"


def sass_loops(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """(the opcodes of a SASS function, in order; its loops as (first, last) opcode indices, a
    back edge's label to its branch)."""
    opcodes, labels, branches = [], {}, []
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        m = _SASS_LINE.match(line)
        if not m:
            continue
        if m.group(1) == "BRA":
            target = _TARGET.search(line)
            if target:
                branches.append((len(opcodes), target.group(1)))
        opcodes.append(m.group(1) + m.group(2))
    loops = sorted({(labels[t], at) for at, t in branches if t in labels and labels[t] <= at})
    return opcodes, loops


def instruction_mix(text: str, loop_weights: int, inner_trips: int = 1) -> dict:
    """SASS instructions per weight of the k-loop, by kind (`KINDS`), in all, and "local" (those of
    them that read or write spilled registers): the k-loop is the outermost loop that loads from
    global memory; a loop nested in it counts `inner_trips` times per pass; one pass handles
    `loop_weights` weights in each thread. Empty where no such loop is."""
    opcodes, loops = sass_loops(text)
    outer = [(a, b) for a, b in loops if not any(c <= a and b <= d and (c, d) != (a, b) for c, d in loops)]
    outer = [(a, b) for a, b in outer if any(op.startswith(("LDG", "ULDG", "LDGSTS")) for op in opcodes[a:b + 1])]
    if not outer or loop_weights <= 0:
        return {}
    a, b = max(outer, key=lambda span: span[1] - span[0])
    inner = [(c, d) for c, d in loops if a <= c and d <= b and (c, d) != (a, b)]
    counts = dict.fromkeys(KINDS, 0.0)
    local = 0.0
    for at in range(a, b + 1):
        times = inner_trips if any(c <= at <= d for c, d in inner) else 1
        counts[kind_of(opcodes[at])] += times
        local += times if opcodes[at].startswith(("LDL", "STL")) else 0
    out = {kind: round(n / loop_weights, 2) for kind, n in counts.items()}
    out["total"] = round(sum(counts.values()) / loop_weights, 2)
    out["loop_instructions"] = int(sum(counts.values()))
    out["local"] = round(local / loop_weights, 4)  # spilled registers read or written in the loop
    return out


def weight_param_indices(spec: KernelSpec) -> set[int]:
    """PTX parameter indices of the weight's pointers (constexpr arguments take no parameter)."""
    runtime = [a for a in spec.fn.arg_names if spec.signature.get(a) != "constexpr"]
    return {runtime.index(a) for a in spec.weight_args}


def occupancy(registers: int, shared: int, num_warps: int, arch: int) -> int:
    """Programs resident per multiprocessor (register file 64 K, 64 warps (48 on sm_89), shared
    memory 164 KB on sm_80, 100 KB on sm_89, 228 KB on sm_90; register allocation in 256-register
    units per warp)."""
    max_warps = 48 if arch == 89 else 64
    smem = {80: 164, 89: 100, 90: 228}.get(arch, 100) * 1024
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = 65536 // (per_warp * num_warps)
    by_warps = max_warps // num_warps
    by_smem = smem // shared if shared else 32
    return max(0, min(by_regs, by_warps, by_smem, 32))


def report(specs: list[KernelSpec], arch: int) -> list[dict]:
    """One dict per kernel: name, family, weight_type, shape, loads by width (share of weight bytes,
    and the count of every global load by width), registers, spills, shared memory, occupancy and,
    per released product, the programs and waves (programs / multiprocessors), and for a decode kernel
the k-loop's SASS instructions per weight by kind (`instruction_mix`)."""
    sms = ARCH_SMS[arch]
    out = []
    for spec in specs:
        ptx, shared = compile_ptx(spec, arch)
        loads = global_loads(ptx, weight_param_indices(spec))
        regs = ptxas_facts(ptx, arch)
        mix = instruction_mix(sass(compile_cubin(spec, arch)), spec.loop_weights, spec.inner_trips) \
            if spec.loop_weights else {}
        resident = occupancy(regs.registers, shared, spec.num_warps, arch)
        grids = []
        for launch in spec.launches:
            programs = spec.programs(launch, sms)
            grids.append({"layer": launch.layer, "n": launch.n, "k": launch.k, "rows": launch.rows,
                          "programs": programs, "waves": round(programs / sms, 2),
                          "resident_waves": round(programs / (sms * resident), 2) if resident else None})
        out.append({
            "name": spec.name, "family": spec.family, "weight_type": spec.weight_type, "shape": spec.shape,
            "arch": f"sm_{arch}", "num_warps": spec.num_warps,
            "weight_load_bytes_by_width": {str(w): round(s, 4) for w, s in loads.weight_bytes_by_width().items()},
            "wide_load_share": round(loads.wide_share(8), 4),
            "weight_loads_by_width": {str(w): n for w, n in sorted(loads.weight.items())},
            "global_loads_by_width": {str(w): n for w, n in sorted(loads.every.items())},
            "registers": regs.registers, "spills": regs.spill_store_bytes + regs.spill_load_bytes,
            "spill_store_bytes": regs.spill_store_bytes, "spill_load_bytes": regs.spill_load_bytes,
            "shared_bytes": shared, "programs_per_sm": resident, "sms": sms, "grids": grids,
            "min_waves": min((g["waves"] for g in grids), default=None),
            "instructions_per_weight": mix,
        })
    return out


def table(rows: list[dict]) -> str:
    """The report as a fixed-width table (one line per kernel)."""
    head = (f"{'kernel':30s} {'loads by width (share of weight bytes)':40s} {'>=8B':>6s} {'regs':>4s} "
            f"{'spill':>5s} {'smem':>6s} {'prog/SM':>7s} {'min waves':>9s} {'SASS/weight int+fp+mem+other':>30s}  at")
    lines = [head]
    for r in rows:
        widths = " ".join(f"{w}B:{100 * s:.0f}%" for w, s in r["weight_load_bytes_by_width"].items() if s > 0)
        worst = min(r["grids"], key=lambda g: g["waves"]) if r["grids"] else None
        at = f"{worst['layer']} ({worst['programs']} programs)" if worst else ""
        waves = f"{r['min_waves']:.2f}" if r["min_waves"] is not None else "-"
        mix = r.get("instructions_per_weight") or {}
        per = (f"{mix['total']:5.2f} = " + "+".join(f"{mix[k]:.2f}" for k in KINDS)) if mix else "-"
        lines.append(f"{r['name']:30s} {widths:40s} {100 * r['wide_load_share']:5.1f}% {r['registers']:4d} "
                     f"{r['spills']:5d} {r['shared_bytes']:6d} {r['programs_per_sm']:7d} {waves:>9s} {per:>30s}  {at}")
    return "\n".join(lines)
