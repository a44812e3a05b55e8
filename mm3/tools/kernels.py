"""`python -m mm3 kernels --report --arch 90`: what the quantized kernels compile to for a CUDA GPU.
`python -m mm3 kernels --frame --config medium --quant Q4_K_M`: the kernels one AR frame launches.

Both need Triton, not a GPU. The report, per kernel (family, weight type, decode or prefill): the
share of the weight's bytes loaded by each load width, registers, spills, shared memory, the grid
and waves it gets at the released sizes, and for decode kernels the k-loop's SASS instructions per
weight by kind (`mm3.backends.gpu.kernel_report`). The frame count runs one AR frame step through
the GPU code path on the CPU (Triton's interpreter, in a process of its own) and counts its device
kernels by kind and by part of the frame (`mm3.bench.frame_kernels`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..constants import SEMANTIC_VOCAB_SIZE
from ..formats.diffusers import DIFFUSERS_DEFAULTS
from .tiny import RELEASED_LM_CONFIG

FAMILIES = ("triton", "layout", "fused", "steps")
PREFILL_ROWS_PER_WINDOW = 689  # latents of a 200-frame DiT window at the released rates (mm3.synth.audio)


def released_launches():
    """(decode, prefill) products at the released sizes (`kernel_report.Launch`): decode is one
    song's AR frame (the CFG pair: 2 rows) through the LM (fused q/k/v and gate/up, as the fast
    numerics run them), its head's candidate rows and the depth decoder; prefill is a DiT window
    (the CFG pair of a window's latents)."""
    from ..backends.gpu.kernel_report import Launch

    lm, depth, dit = RELEASED_LM_CONFIG, DIFFUSERS_DEFAULTS["rvq_depth_decoder"], DIFFUSERS_DEFAULTS["transformer"]
    h, hd = lm["hidden_size"], lm["head_dim"]
    q, kv, ffn = lm["num_attention_heads"] * hd, lm["num_key_value_heads"] * hd, lm["intermediate_size"]
    dh, dffn = depth["hidden_size"], depth["intermediate_size"]
    decode = [Launch("lm.qkv", q + 2 * kv, h, 2), Launch("lm.o_proj", h, q, 2),
              Launch("lm.gate_up", 2 * ffn, h, 2), Launch("lm.down_proj", h, ffn, 2),
              Launch("lm.head", SEMANTIC_VOCAB_SIZE + 1, h, 2),
              Launch("depth.qkv", 3 * dh, dh, 2), Launch("depth.to_out", dh, dh, 2),
              Launch("depth.gate_up", 2 * dffn, dh, 2), Launch("depth.down_proj", dh, dffn, 2),
              Launch("depth.projection", dh, h, 2), Launch("depth.audio_head", depth["audio_vocab_size"], dh, 2)]
    inner = dit["num_attention_heads"] * dit["attention_head_dim"]
    rows = 2 * PREFILL_ROWS_PER_WINDOW
    prefill = [Launch("dit.qkv", 3 * inner, inner, rows), Launch("dit.to_out", inner, inner, rows),
               Launch("dit.ff_in", 2 * dit["ff_inner_dim"], inner, rows),
               Launch("dit.ff_out", inner, dit["ff_inner_dim"], rows),
               Launch("dit.proj_in", inner, 2 * dit["in_channels"] + dit["condition_dim"], rows)]
    return decode, prefill


def specs(families=FAMILIES, weight_types=None, shapes=None) -> list:
    """The kernels of `families` with the released products (only those of `weight_types` and
    `shapes`, "decode" / "prefill", when given)."""
    decode, prefill = released_launches()
    out = []
    if "triton" in families:
        from ..backends.gpu import kernels

        out += kernels.report_specs(decode, prefill)
    if "layout" in families:
        from ..backends.gpu import layout_specs

        out += layout_specs.report_specs(decode, prefill)
    if "steps" in families:
        from ..backends.gpu import step_specs

        out += step_specs.report_specs(decode)
    if "fused" in families:
        from ..backends.gpu import layout_specs

        out += layout_specs.fused_report_specs(decode)
    return [s for s in out if (weight_types is None or s.weight_type in weight_types)
            and (shapes is None or s.shape in shapes)]


def report(arch: int, families=FAMILIES, weight_types=None, shapes=None) -> list[dict]:
    """`kernel_report.report` of `specs(families, weight_types, shapes)` for `sm_<arch>`. Under Triton's
    interpreter (`TRITON_INTERPRET=1`) kernels are not compiled in-process: a fresh process without
    it makes the report."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = ("import json, sys; from mm3.tools.kernels import report; "
                "print(json.dumps(report(*json.loads(sys.argv[1]))))")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        args = json.dumps([arch, list(families), weight_types and list(weight_types), shapes and list(shapes)])
        done = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True, env=env,
                              timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"the kernel report for sm_{arch} failed: {done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    from ..backends.gpu.kernel_report import report as compile_report

    return compile_report(specs(families, weight_types, shapes), arch)


def frame_count(config: str, quant: str, layers: int = 0, work: str | None = None) -> dict:
    """The kernels of one AR frame on the GPU code path (`mm3.bench.frame_kernels.count_frame`), counted in
    a process of its own: Triton's interpreter is chosen when Triton is first imported."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    argv = [sys.executable, "-m", "mm3.bench.frame_kernels", "--config", config, "--quant", quant, "--json", "-"]
    if layers:
        argv += ["--layers", str(layers)]
    if work:
        argv += ["--work", work]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the frame count failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout[done.stdout.index("{"):])


def _frame_cli(args) -> int:
    from ..errors import InputError

    quant = args.quant.upper()
    from .quantize import MIXES

    if quant not in MIXES:
        raise InputError(f"--quant {args.quant}: expected one of {', '.join(MIXES)}")
    if args.layers < 0:
        raise InputError(f"--layers {args.layers}: expected a number of LM layers (0: the config's)")
    report = frame_count(args.config, quant, args.layers, args.work)
    if args.json == "-":
        print(json.dumps(report, indent=2))
        return 0
    print("\n".join(frame_lines(report)))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def frame_lines(report: dict) -> list[str]:
    """A frame count as a table by kind and by part."""
    out = [(f"one AR frame, config {report['config']}, {report['quant']}, {report['dtype']}, {report['rows']} LM rows "
            f"(CFG), KV bucket {report['bucket']}: {report['total']} kernels")]
    if report.get("note"):
        out.append(f"  ({report['note']})")
    out.append(f"  {'kind':22s} {'kernels':>8s}")
    out += [f"  {k:22s} {v:8d}" for k, v in report["by_kind"].items()]
    out.append(f"  {'part':22s} {'kernels':>8s}")
    out += [f"  {k:22s} {v:8d}" for k, v in report["by_part"].items()]
    out.append(f"  one LM layer: {', '.join(map(str, report['lm_layer_kernels']))} kernels; host syncs: "
               f"{report['host_syncs']}")
    return out


def _cli(args) -> int:
    from ..errors import InputError
    from ..backends.gpu.kernel_report import ARCH_SMS, table

    if args.frame and args.report:
        raise InputError("kernels: pass --report or --frame, not both")
    if args.frame:
        return _frame_cli(args)
    if not args.report:
        raise InputError("kernels: nothing to do; pass --report or --frame")
    if args.arch not in ARCH_SMS:
        raise InputError(f"--arch {args.arch}: expected one of {', '.join(map(str, ARCH_SMS))}")
    families = FAMILIES if args.family == "all" else (args.family,)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise InputError("kernels --report needs Triton (it compiles the kernels with Triton's compilers)") from None
    types = [t.strip().upper() for t in args.types.split(",")] if args.types else None
    shapes = [args.shape] if args.shape != "all" else None
    rows = report(args.arch, families, types, shapes)
    if not rows:
        raise InputError(f"no kernel of family {args.family} for --types {args.types!r} and --shape {args.shape}")
    if args.json == "-":
        print(json.dumps(rows, indent=2))
        return 0
    print(f"sm_{args.arch} ({ARCH_SMS[args.arch]} SMs)")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("kernels", help="what the GPU kernels compile to, and how many one AR frame launches "
                              "(no GPU needed)", description=__doc__)
    p.add_argument("--report", action="store_true", help="compile every kernel and print the report")
    p.add_argument("--frame", action="store_true", help="count the device kernels of one AR frame on the GPU code "
                   "path, by kind and by part (run on the CPU under Triton's interpreter)")
    p.add_argument("--config", choices=("tiny", "medium", "real"), default="medium",
                   help="--frame: the bench's model sizes (real: the released ones, its LM layers scaled; "
                   "default medium)")
    p.add_argument("--quant", default="Q4_K_M", help="--frame: the weights' quant mix (default Q4_K_M)")
    p.add_argument("--layers", type=int, default=0, help="--frame: LM layers run (0: the config's; real: 2, "
                   "scaled to 36)")
    p.add_argument("--work", default=None, help="--frame: folder of the random model files (kept and reused; "
                   "default: the cache folder)")
    p.add_argument("--arch", type=int, default=90, help="CUDA architecture: 80, 89 or 90 (default 90)")
    p.add_argument("--family", choices=FAMILIES + ("all",), default="all",
                   help="triton: the kernels over GGUF blocks; layout: over the device layout; fused: the layout's "
                   "decode kernels with SwiGLU, their in-kernel split-K sum, the two-type q/k/v kernel; steps: the "
                   "AR frame's norms, attention, draws and embedding lookups; all (default)")
    p.add_argument("--types", default="", help="only these weight types, comma-separated (e.g. Q8_0,Q4_K)")
    p.add_argument("--shape", choices=("decode", "prefill", "all"), default="all", help="only decode or prefill kernels")
    p.add_argument("--json", metavar="OUT", default=None, help="also write the report (or the frame count) as JSON "
                   "to OUT ('-': print only the JSON)")
    p.set_defaults(func=_cli)
