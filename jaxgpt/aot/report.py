"""The analysis of a compiled program, typed: its memory per device (`Memory`), flops, collectives and
custom calls (`ProgramReport`, whose `as_dict` is the --json form scripts read), the refusal of a program
that does not fit (`DoesNotFit`), and the report's text for a terminal (`format_result`)."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from jaxgpt.aot.targets import GIB, Devices

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
_COMPUTATION_RE = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{\s*$")
_COLLECTIVE_RE = re.compile(r"\s(all-gather|reduce-scatter|all-reduce|all-to-all)(?:-start)?\(")


class DoesNotFit(RuntimeError):
    """The compiled program needs more memory per device than the target has."""

    def __init__(self, program: str, target: str, peak_bytes: Optional[int], limit_bytes: Optional[int],
                 detail: str = "", result: Optional[dict] = None):
        self.program, self.target = program, target
        self.peak_bytes, self.limit_bytes, self.result = peak_bytes, limit_bytes, result
        need = "more than the limit" if peak_bytes is None else f"{peak_bytes / GIB:.2f} GiB"
        have = "unknown" if limit_bytes is None else f"{limit_bytes / GIB:.2f} GiB"
        super().__init__(f"the {program} does not fit {target}: peak {need} per device, limit {have}"
                         + (f" ({detail})" if detail else ""))


@dataclasses.dataclass(frozen=True)
class Memory:
    """A compiled program's device memory per device. `peak_bytes` is what the device holds during the
    call: arguments, outputs not aliased to a (donated) argument, and temporaries; it is the sum the TPU
    compiler checks against HBM (its refusal, "memory required for HLO temporaries (X) exceeds available
    HBM", states that X) and what a GPU allocates. The compiler's own `peak_memory_in_bytes` is kept as
    `compiler_peak_bytes` but not used: libtpu's counts live buffers in every memory space (a copy
    prefetched into VMEM too) and its temporaries are HBM's alone, so at tiny sizes it is above or
    below the temporaries (0.12M params: the generate program's 1.4 MB against 2.3 MB of temporaries).
    `host_temp_bytes`: temporaries in the host's memory (remat="offload"'s saved block inputs), not in the
    peak."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    compiler_peak_bytes: Optional[int]
    host_temp_bytes: int = 0

    @classmethod
    def of(cls, compiled) -> Optional["Memory"]:
        """The compiled program's memory analysis; None where the compiler gives none."""
        m = compiled.memory_analysis()
        if m is None:
            return None
        args, outs, alias, temps = (int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                                    int(m.alias_size_in_bytes), int(m.temp_size_in_bytes))
        return cls(args, outs, alias, temps, int(m.generated_code_size_in_bytes), args + outs - alias + temps,
                   int(getattr(m, "peak_memory_in_bytes", 0) or 0) or None,
                   int(getattr(m, "host_temp_size_in_bytes", 0) or 0))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def memory_dict(compiled) -> dict:
    """`Memory.of(compiled)` in its --json form ({} where the compiler gives no analysis)."""
    mem = Memory.of(compiled)
    return {} if mem is None else mem.as_dict()


@dataclasses.dataclass
class ProgramReport:
    """The figures of one compiled program. `details` are the program's own (batch, dtype, kernels, ...),
    `more` what its compiler adds after the analysis (the engine's prefill programs and slots that fit);
    `as_dict()` is the --json form, whose field names (`argument_bytes`, `temp_bytes`, `peak_bytes`,
    `fits`, ...) scripts read."""

    program: str
    details: dict
    compile_s: float
    memory: Optional[Memory]
    memory_bytes: int
    limit_bytes: int
    fits: bool
    flops_per_device: Optional[float]
    formula_flops_per_device: Optional[float]
    flops_counted_for: Optional[str]
    flops_ratio: Optional[float]
    collectives: dict
    custom_calls: dict
    more: dict = dataclasses.field(default_factory=dict)

    @property
    def peak_bytes(self) -> Optional[int]:
        return None if self.memory is None else self.memory.peak_bytes

    @property
    def argument_bytes(self) -> Optional[int]:
        return None if self.memory is None else self.memory.argument_bytes

    @property
    def temp_bytes(self) -> Optional[int]:
        return None if self.memory is None else self.memory.temp_bytes

    def as_dict(self) -> dict:
        analysis = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("program", "details", "compile_s", "memory", "more")}
        return {"program": self.program, **self.details, "compile_s": self.compile_s,
                **({} if self.memory is None else self.memory.as_dict()), **analysis, **self.more}


def analyze(program: str, compiled, seconds: float, devs: Devices, formula_flops: Optional[float], details: dict,
            loop_trips: int = 1, layer_loop: bool = False, loss_loop: bool = False) -> ProgramReport:
    """The figures of one compiled program. XLA's cost analysis counts a while loop's body once: the
    compiler's flops are compared with the formula over `loop_trips` (grad_accum micro-batches times
    steps_per_call), and not at all when the layers run as a loop (scan_layers: one layer counted) or the
    loss does (train.loss_chunk: one chunk of the head counted)."""
    mem = Memory.of(compiled)
    flops = _flops(compiled)
    hlo = compiled.as_text() or ""
    comparable = formula_flops and flops is not None and not layer_loop and not loss_loop
    once = " and ".join(w for w, on in (("one layer (scan_layers)", layer_loop),
                                        ("one chunk of the loss (train.loss_chunk)", loss_loop)) if on)
    return ProgramReport(
        program, details, round(seconds, 2), mem, devs.memory_bytes, devs.limit_bytes,
        fits=(0 if mem is None else mem.peak_bytes) <= devs.limit_bytes,
        flops_per_device=flops, formula_flops_per_device=formula_flops,
        flops_counted_for=(None if not formula_flops else once if once else
                           f"1/{loop_trips} of the step (XLA counts a loop body once)" if loop_trips > 1 else
                           "the whole step"),
        flops_ratio=round(flops * loop_trips / formula_flops, 4) if comparable else None,
        collectives=count_collectives(hlo), custom_calls=count_custom_calls(hlo))


def count_collectives(hlo_text: str) -> dict:
    """How many all-gather, reduce-scatter, all-reduce and all-to-all instructions the compiled HLO text
    holds (an async start counts once). The TPU compiler writes a reduce-scatter as a fusion that calls an
    `all-reduce-scatter` computation (an all-reduce and a dynamic slice): each such call is a reduce-scatter,
    and the all-reduce inside it is not counted again."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    computation = ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header:
            computation = header.group(1)
            continue
        if "calls=%all-reduce-scatter" in line:
            counts["reduce-scatter"] += 1
        if computation.startswith("all-reduce-scatter"):
            continue
        for m in _COLLECTIVE_RE.finditer(line):
            counts[m.group(1)] += 1
    return counts


def count_custom_calls(hlo_text: str) -> dict:
    """Custom-call targets in the compiled HLO text and how often each is called: Pallas kernels show
    as tpu_custom_call (TPU) or __gpu$xla.gpu.triton (GPU), cuDNN's attention as __cudnn$fmha..."""
    counts: dict = {}
    for m in re.finditer(r'custom_call_target="([^"]+)"', hlo_text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def _flops(compiled) -> Optional[float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost or cost["flops"] < 0:
        return None
    return float(cost["flops"])


_SIZE = r"([\d.]+)([KMGT]?)"
# libtpu's refusals: "... memory required for HLO temporaries (77.05G) exceeds available HBM (15.75G)",
# or "Used 20.5G of 15.75G hbm"
_OOM_RES = (re.compile(rf"\({_SIZE}\) exceeds available HBM \({_SIZE}\)"), re.compile(rf"Used {_SIZE} of {_SIZE} hbm", re.I))
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _oom_figures(message: str) -> tuple[Optional[int], Optional[int]]:
    """(needed, limit) bytes per device from a TPU compiler RESOURCE_EXHAUSTED message, where it says."""
    for pattern in _OOM_RES:
        m = pattern.search(message)
        if m:
            need, limit = (int(float(m.group(i)) * _UNITS[m.group(i + 1).upper()]) for i in (1, 3))
            return need, limit
    return None, None


def _gib(b) -> str:
    return "?" if b is None else f"{b / GIB:.2f} GiB"


def format_result(result: dict) -> str:
    """The figures of compile_for_target as lines for a terminal."""
    m = result["model"]
    lines = [f"target {result['target']}: {result['device_count']} x {result['device_kind']}, "
             f"{_gib(result['memory_bytes'])} each (limit {_gib(result['limit_bytes'])}); model "
             f"{m['n_params'] / 1e6:.2f}M params, vocab {m['vocab_size']}, context {m['block_size']}"]
    for p in result["programs"].values():
        if "compile_s" not in p:
            lines.append(f"{p['program']}: does not fit (peak {_gib(p['peak_bytes'])}, limit {_gib(p['limit_bytes'])})")
            continue
        if p["program"] == "train step":
            head = (f"train step via {p['parallel']}: batch {p['batch_size']} x {p['seq_len']} ({p['per_device_batch']} "
                    f"rows per device), grad_accum {p['grad_accum']}, steps_per_call {p['steps_per_call']}, remat "
                    f"{p['remat']}, dtype {p['dtype']}, kernels {p['kernels']}"
                    + (f", loss in chunks of {p['loss_chunk']} positions" if p.get("loss_chunk") else ""))
        elif p["program"] == "engine decode step":
            head = (f"engine: {p['slots']} slots of {p['max_len']} positions (KV cache {_gib(p['cache_bytes'])}, "
                    f"{p['cache_bytes_per_slot'] / 2 ** 20:.1f} MiB a slot, {p.get('kv_dtype', p['dtype'])}), "
                    + (f"on mesh {p['mesh']} ({_gib(p.get('cache_bytes_per_chip'))} of cache and "
                       f"{_gib(p.get('weight_bytes_per_chip'))} of weights per device), " if p.get("mesh") else "")
                    + f"prefill chunks of {p['chunk']}, dtype {p['dtype']}, weights {p.get('quantize') or p['dtype']} "
                    f"({_gib(p.get('weight_bytes'))}), kernels {p['kernels']}; each slot takes "
                    f"{p['bytes_per_slot'] / 2 ** 20:.1f} MiB in the compiled step; slots of {p['max_len']} positions "
                    f"that fit beside the weights: {p['slots_that_fit']}; prefill program peak "
                    f"{_gib(p['prefill'].get('peak_bytes'))}"
                    + (f"; packed prefill of {p['prefill_packed']['tokens']} tokens peak "
                       f"{_gib(p['prefill_packed'].get('peak_bytes'))}" if p.get("prefill_packed") else ""))
        elif p["program"] == "paged engine step":
            head = (f"paged engine: up to {p['max_requests']} requests of up to {p['max_len']} positions, pages of "
                    f"{p['page_size']}, {p['token_budget']} tokens a step, {p['programs']} programs"
                    + (" (only the largest compiled, --engine_largest_only)" if p.get("largest_only") else "")
                    + f" (the largest, "
                    f"{p['largest']}, below), dtype {p['dtype']}, weights {p.get('quantize') or p['dtype']} "
                    f"({_gib(p.get('weight_bytes'))}), cache {p['kv_dtype']}, kernels {p['kernels']}; a page takes "
                    f"{p['bytes_per_page'] / 2 ** 10:.0f} KiB in the compiled step ({p['page_bytes'] / 2 ** 10:.0f} KiB "
                    f"of keys and values); tokens of cache that fit beside the weights: {p['tokens_that_fit']} "
                    f"({p['pages_that_fit']} pages)")
        else:
            head = (f"generate: batch {p['batch_size']}, prompt {p['prompt_len']}, {p['max_new_tokens']} new tokens, "
                    f"dtype {p['dtype']}, kernels {p['kernels']}" + (f", mesh {p['mesh']}" if p.get("mesh") else "")
                    + (", weights given in the compute dtype" if p.get("weights") == "compute" else ""))
        lines.append(head)
        lines.append(f"  compiled in {p['compile_s']:.1f}s; per device: arguments {_gib(p['argument_bytes'])}, outputs "
                     f"{_gib(p['output_bytes'])} (aliased {_gib(p['alias_bytes'])}), temporaries {_gib(p['temp_bytes'])}; "
                     f"peak (their sum, aliased outputs once) {_gib(p['peak_bytes'])} of {_gib(p['limit_bytes'])}: "
                     f"{'fits' if p['fits'] else 'DOES NOT FIT'}"
                     + (f"; in host memory {_gib(p['host_temp_bytes'])}" if p.get("host_temp_bytes") else ""))
        if p.get("formula_flops_per_device"):
            got = "not reported by this compiler" if p["flops_per_device"] is None else \
                f"{p['flops_per_device']:.4g} (compiler, for {p['flops_counted_for']})"
            ratio = "" if p["flops_ratio"] is None else f"; compiler over formula {p['flops_ratio']:.3f}"
            if ratio and p["custom_calls"].get("tpu_custom_call"):  # Mosaic kernels: their flops go uncounted
                ratio += (" (libtpu does not count the Pallas kernels' flops, here attention's; "
                          "--config.model.kernels=portable compares the whole step)")
            formula = "6N + 12LTD" + (" + remat's recomputed forward" if p.get("remat") in ("block", "offload") else "")
            lines.append(f"  flops per device: {got}; {formula} for the step {p['formula_flops_per_device']:.4g}{ratio}")
        elif p["flops_per_device"] is not None:
            lines.append(f"  flops per device: {p['flops_per_device']:.4g} (compiler)")
        lines.append("  collectives: " + ", ".join(f"{k} {v}" for k, v in p["collectives"].items())
                     + ("; custom calls: " + ", ".join(f"{k} {v}" for k, v in p["custom_calls"].items())
                        if p["custom_calls"] else ""))
    return "\n".join(lines)
