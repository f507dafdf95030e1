"""End-to-end decode: transformers CausalLMs at real dims (random weights; Llama-3.2-1B whole, a
few layers of the larger ones), one decode step — one new token per sequence, a static KV cache
holding a 256-token prefix — captured in a CUDA graph and replayed: eager vs torch.compile vs
fuser, and fuser with each of its step-level features switched off on its own.

    PYTHONPATH=. python benchmarks/bench_decode.py [--models llama_1b,qwen3_8b,deepseek_v4_flash] [--batches 1,8,32,128]
                                                   [--variants eager,compile,fuser,...]
    PYTHONPATH=. python benchmarks/bench_decode.py --apply-time   # fuser.apply on 43 DSv4-Flash-shape layers

Every variant runs the same model code on the same weights, from its own copy of one prefilled
cache. torch.compile compiles the model's forward as transformers documents for a static-cache
decode step (``torch.compile(model.forward)``; its own CUDA graphs off, since the step is
captured here as for every variant). Each fuser variant (:data:`FUSER_VARIANTS`: a name and the
options of its ``fuser.apply``) fuses once, on a step at batch 8, and serves every batch.

Where a step's time goes, per row: ``step µs`` (CUDA events over back-to-back replays); ``busy
µs``, the time at least one kernel runs (the union of the kernels' intervals in a torch.profiler
trace of replays) and ``idle µs`` = step - busy (launch gaps, the GPU waiting); ``heavy`` and
``glue`` µs and launches (glue told from heavy as ``fuser.tools.bench`` tells them: marker
kernels around every heavy call and leaf in an eager forward, classes taken by position in the
replay; heavy µs = all kernel time - glue µs); and ``roofline``: the weight bytes the step reads
(:func:`benchmarks.causal_lms.weight_bytes`; a MoE layer's routed experts counted as
``min(E, top_k x batch)`` of them, an upper bound) over the bandwidth of a >= 1 GB
device-to-device copy measured once per run, over the step time — 100% is a step that does
nothing but read its weights at copy speed. Writes benchmarks/results/decode.{json,md} after
every row: a run cut short keeps what it measured.

A fuser variant with merged projections makes the layers' parameters (shared by every variant)
views of its merged weights; a second such variant merges them again at its first call outside
a capture (a warm-up), and the first keeps its own merged copy: its graphs replay unchanged.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import fuser  # noqa: E402
from benchmarks.causal_lms import MODELS, causal_lm, experts_read, roofline_share, roofline_us, weight_bytes  # noqa: E402
from examples.zoo import layers as zoo  # noqa: E402
from fuser.codegen.emit import kernel_dir  # noqa: E402
from fuser.tools import bench  # noqa: E402
from fuser.tools.capture import busy_us, capture_decode, replay_kernels, replay_time_us  # noqa: E402

OUT = ROOT / "benchmarks/results"
PREFIX = 256
ROOM = 96  # cache slots past the prefix: each variant's warm-ups and replays (about 75) write one each
REPLAYS = 10  # replays traced for the busy time
#: fuser's variants, (name, ``fuser.apply`` options): all features on, then each step-level
#: feature off on its own. A new feature adds one line.
FUSER_VARIANTS = (
    ("fuser", {}),
    ("fuser -merge_projections", dict(disable_passes=("merge_projections",))),
    ("fuser -pdl", dict(disable_passes=("pdl",))),
    ("fuser -residual_in_gemm", dict(disable_passes=("residual_in_gemm",))),
    ("fuser -decode_gemm", dict(disable_passes=("decode_gemm",))),
    ("fuser -gated_in_gemm", dict(disable_passes=("gated_in_gemm",))),
    ("fuser -decode_attention", dict(disable_passes=("decode_attention",))),
    ("fuser -cache_write_in_attention", dict(disable_passes=("cache_write_in_attention",))),
    ("fuser -combine_in_attention", dict(disable_passes=("combine_in_attention",))),
    ("fuser -norm_in_gemm", dict(disable_passes=("norm_in_gemm",))),
    ("fuser -early_weights", dict(disable_passes=("early_weights",))),
    ("fuser -activation_in_gemm", dict(disable_passes=("activation_in_gemm",))),
    ("fuser -glue_across_layers", dict(disable_passes=("glue_across_layers",))),
    ("fuser -upcast_in_gemm", dict(disable_passes=("upcast_in_gemm",))),
)
VARIANTS = ("eager", "compile") + tuple(name for name, _ in FUSER_VARIANTS)


def prefilled(model, batch: int):
    """A static cache holding PREFIX tokens per sequence, and the next token of each."""
    ids = torch.randint(0, model.config.vocab_size, (batch, PREFIX), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    cache = zoo.static_cache(model.config, PREFIX + ROOM)  # plain layers: a sliding one cannot be captured
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    return cache, logits[:, -1:].argmax(-1)


def step(model, tokens, cache) -> dict:
    """The decode step's keyword arguments. Where the model attends with transformers' eager
    attention (DeepSeek-V4), its masks are made here, before the step, as ``generate()`` makes
    them (``create_masks_for_generate``) and the forward takes them: the eager mask is made with
    ``torch.tensor(0.0, device=...)`` (transformers 5.19, ``masking_utils.py:606``), a copy from
    host memory that no CUDA graph can capture (a serving engine keeps such metadata in static
    buffers, written outside the graph). The same masks for every variant."""
    kwargs = dict(input_ids=tokens, past_key_values=cache, use_cache=True, cache_position=torch.tensor([PREFIX], device="cuda"))
    if model.config._attn_implementation == "eager":
        from transformers.masking_utils import create_masks_for_generate

        with torch.no_grad():
            embeds = model.get_input_embeddings()(tokens)
            positions = (torch.arange(tokens.shape[1], device=tokens.device) + PREFIX).unsqueeze(0)
            kwargs["attention_mask"] = create_masks_for_generate(
                config=model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=cache, position_ids=positions
            )
    return kwargs


def sharing_weights(model):
    """Another instance of ``model`` on the very same parameter tensors."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def measure(variant: str, forward, batch: int, weights: int, copy_gbps: float) -> dict:
    """The row of one variant at one batch: capture, time, classify and trace its replays."""
    capture = capture_decode(forward, lambda bs: (), [batch], variant=variant)
    if batch not in capture.graphs:
        return dict(variant=variant, batch=batch, failed=capture.failed.get(batch))
    graph = capture.graphs[batch].graph
    step_us = replay_time_us(graph)
    classes = bench.kernel_classes(forward, (), heavy_calls=variant != "compile")
    glue, heavy_launches, note, totals = bench.profile_replay(graph, classes, replays=REPLAYS)
    kernels = replay_kernels(graph, REPLAYS)
    row = timing_row(variant, batch, step_us, glue, heavy_launches, kernels, REPLAYS, weights, copy_gbps, note)
    return dict(row, top_kernels=top_kernels(totals, REPLAYS))


def top_kernels(totals: dict[str, list[float]], replays: int, count: int = 12) -> dict[str, list]:
    """The kernels that take most of a step, glue and heavy alike: name -> [µs a step, launches
    a step] (each launch's µs the time it adds to the busy time), the ``count`` largest."""
    rows = sorted(((name[:80], sum(us) / replays, len(us) / replays) for name, us in totals.items()), key=lambda r: -r[1])
    return {name: [round(us, 1), round(n, 1)] for name, us, n in rows[:count]}


def timing_row(variant: str, batch: int, step_us: float, glue: list[tuple[str, float]], heavy_launches: int,
               kernels: list[tuple[str, float, float]], replays: int, weights: int, copy_gbps: float, note: str = "") -> dict:  # fmt: skip
    """A row from what was measured: ``glue`` [(kernel, µs)] of one replay, each kernel's µs the
    time it adds to the busy time (``fuser.tools.capture.exposed_us``), ``kernels`` [(name, start
    µs, end µs)] of ``replays`` replays, ``weights`` bytes read per step. Heavy µs is the rest of
    the busy time."""
    busy = busy_us(kernels) / replays
    glue_us = sum(us for _, us in glue)
    by_name: dict[str, float] = {}
    for name, us in glue:
        by_name[name[:80]] = by_name.get(name[:80], 0.0) + us
    top = dict(sorted(((n, round(us, 1)) for n, us in by_name.items()), key=lambda x: -x[1])[:8])
    return dict(variant=variant, batch=batch, step_us=round(step_us, 1), tokens_per_s=round(batch / step_us * 1e6),
                busy_us=round(busy, 1), idle_us=round(step_us - busy, 1),
                heavy_us=round(busy - glue_us, 1), heavy_launches=heavy_launches,
                glue_us=round(glue_us, 1), glue_launches=len(glue), glue_share=round(glue_us / busy, 3) if busy else None,
                weight_bytes=weights, roofline_us=round(roofline_us(weights, copy_gbps), 1),
                roofline_share=round(roofline_share(weights, copy_gbps, step_us), 3),
                note=note, top_glue=top, glue_order=[name[:60] for name, _ in glue])  # fmt: skip


def fused_variants(model, variants, record: dict, log) -> dict:
    """Each fuser variant of ``variants``: a model on the same weights, fused with its options
    on a step at batch 8 (apply times and reports into ``record``; a failed apply there too)."""
    fused = {}
    chosen = [(name, options) for name, options in FUSER_VARIANTS if name in variants]
    if not chosen:
        return fused
    cache, tokens = prefilled(model, 8)
    for name, options in chosen:
        target = sharing_weights(model)
        started = time.perf_counter()
        try:
            report = fuser.apply(target, (), example_kwargs=step(model, tokens, copy.deepcopy(cache)), **options)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            record["apply_failed"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{record['model']}: {name}: fuser.apply failed: {record['apply_failed'][name]}")
            continue
        record["apply_s"][name] = round(time.perf_counter() - started, 1)
        record["fuser_reports"][name] = report.text()
        fused[name] = target
        log(f"{record['model']}: {name}: fuser.apply {record['apply_s'][name]} s")
    del cache
    return fused


def run(name: str, batches: tuple[int, ...], variants=VARIANTS, copy_gbps: float | None = None,
        save=lambda record: None, log=print) -> dict:  # fmt: skip
    """The model's rows, batch by batch, variant by variant (``save`` is called with the record
    after each row)."""
    copy_gbps = copy_gbps or bench.copy_bandwidth_gbps()
    model = causal_lm(name)
    record = dict(model=name, layers=model.config.num_hidden_layers, prefix=PREFIX, stamp=bench.stamp(), copy_gbps=round(copy_gbps),
                  apply_s={}, apply_failed={}, fuser_reports={}, rows=[])  # fmt: skip
    routed = experts_read(model.config, 1)
    if routed:
        record["routed_experts"] = (f"min({routed[1]}, {routed[0]} x batch) of {routed[1]} per MoE layer "
                                    "(each token's choices assumed distinct: an upper bound)")  # fmt: skip
    fused = fused_variants(model, variants, record, log)
    compiled_forward = torch.compile(sharing_weights(model).forward, dynamic=False) if "compile" in variants else None
    started = time.perf_counter()
    for batch in batches:
        cache, tokens = prefilled(model, batch)
        weights = weight_bytes(model, batch)
        for variant in (v for v in VARIANTS if v in variants):
            kwargs = step(model, tokens, copy.deepcopy(cache))
            compile_s = None
            try:
                if variant == "compile":
                    compile_s, forward = warm_compiled(compiled_forward, kwargs)
                elif variant == "eager":
                    forward = functools.partial(model, **kwargs)
                elif variant in fused:
                    forward = functools.partial(fused[variant], **kwargs)
                else:
                    raise RuntimeError(f"fuser.apply failed: {record['apply_failed'].get(variant)}")
                row = measure(variant, forward, batch, weights, copy_gbps)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                row = dict(variant=variant, batch=batch, failed=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            row["compile_s"] = compile_s
            record["rows"].append(row)
            save(record)
            log(f"[{time.perf_counter() - started:6.1f} s] {name} batch {batch} {variant}: " + progress(row))
            del kwargs
        del cache
        torch.cuda.empty_cache()
    return record


def warm_compiled(compiled_forward, kwargs) -> tuple[float, object]:
    """The compiled forward's first call at this batch (its compile), timed; and the forward."""
    forward = functools.partial(compiled_forward, **kwargs)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.no_grad():
        forward()
    torch.cuda.synchronize()
    return round(time.perf_counter() - started, 1), forward


def progress(row: dict) -> str:
    if row.get("failed"):
        return f"failed: {row['failed']}"
    return (f"step {row['step_us']} µs, busy {row['busy_us']}, idle {row['idle_us']}, heavy {row['heavy_us']} "
            f"({row['heavy_launches']}), glue {row['glue_us']} ({row['glue_launches']}), roofline {row['roofline_share']:.0%}")  # fmt: skip


def apply_time(layers: int = 43) -> dict:
    """fuser.apply on a DSv4-Flash-shape model of ``layers`` layers (8 routed experts, so that
    it fits): cold (no kernel on disk), then warm (a fresh copy, the kernels cached)."""
    model = causal_lm("deepseek_v4_flash", layers=layers, n_routed_experts=8)
    cache, tokens = prefilled(model, 8)
    times = {}
    for kind in ("cold", "warm"):
        target = sharing_weights(model)
        torch.cuda.synchronize()
        started = time.perf_counter()
        report = fuser.apply(target, (), example_kwargs=step(model, tokens, copy.deepcopy(cache)))
        times[kind] = round(time.perf_counter() - started, 1)
        print(kind, times[kind], "s;", report.launches_before, "->", report.launches_after, "launches", flush=True)
        fuser.restore(target)
    fused = sum(len(g.layers) for g in report.groups if g.report)
    eager = {layer: g.eager for g in report.groups if g.eager for layer in g.layers}
    near_ties = {layer: tokens for g in report.groups for layer, tokens in g.near_ties.items()}
    return dict(layers=layers, routed_experts=8, apply_s=times, stamp=bench.stamp(), structures=len(report.groups),
                layers_fused=fused, layers_eager=eager, near_ties=near_ties,
                launches=[report.launches_before, report.launches_after], kernel_cache=str(kernel_dir()))  # fmt: skip


COLUMNS = ("batch", "variant", "step µs", "tokens/s", "busy µs", "idle µs", "heavy µs", "heavy launches",
           "glue µs", "glue launches", "glue share", "roofline", "compile s")  # fmt: skip
KEYS = ("batch", "variant", "step_us", "tokens_per_s", "busy_us", "idle_us", "heavy_us", "heavy_launches",
        "glue_us", "glue_launches", "glue_share", "roofline_share", "compile_s")  # fmt: skip
PERCENT = ("glue_share", "roofline_share")


def cell(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    return f"{value:.0%}" if key in PERCENT else str(value)


def applies(record: dict) -> str:
    """fuser.apply's time of each variant (a number: a record of the one-variant format)."""
    times = record.get("apply_s")
    if not isinstance(times, dict):
        return f"fuser.apply: {times} s."
    said = [f"{name} {s} s" for name, s in times.items()] + [f"{name} failed: {why}" for name, why in record.get("apply_failed", {}).items()]
    return "fuser.apply: " + ("; ".join(said) or "not run") + "."


def weights_line(record: dict) -> list[str]:
    """Weight bytes read per step and the roofline step time at each batch, from the rows."""
    seen = {}
    for r in record["rows"]:
        if "weight_bytes" in r:
            seen.setdefault(r["batch"], (r["weight_bytes"], r["roofline_us"]))
    if not seen:
        return []
    per_batch = "; ".join(f"batch {b}: {w / 1e9:.2f} GB, {us:.0f} µs" for b, (w, us) in seen.items())
    line = (f"Weights read per step and the step at the weight-bandwidth roofline (a device-to-device copy: "
            f"{record['copy_gbps']} GB/s, read + written): {per_batch}.")  # fmt: skip
    if record.get("routed_experts"):
        line += f" Routed experts read: {record['routed_experts']}."
    return [line, ""]


def markdown(results: dict) -> str:
    lines = ["# Decode step, end to end: eager / torch.compile / fuser", ""]
    for name, record in results.get("models", {}).items():
        s = record["stamp"]
        lines += [
            f"## {name} ({record['layers']} layers, real dims, bf16, static cache of {record.get('prefix', PREFIX)} tokens)",
            "",
            f"{s['gpu']}, torch {s['torch']}, triton {s['triton']}, commit {s['commit']}. {applies(record)}",
            "",
            *weights_line(record),
            "| " + " | ".join(COLUMNS) + " |",
            "|" + "---|" * len(COLUMNS),
        ]
        for r in record["rows"]:
            if r.get("failed"):
                lines.append(f"| {r['batch']} | {r['variant']} | failed: {r['failed']} |" + " |" * (len(COLUMNS) - 3))
                continue
            lines.append("| " + " | ".join(cell(r, key) for key in KEYS) + " |")
        lines.append("")
    if "apply_time" in results:
        a = results["apply_time"]
        lines += [f"## fuser.apply on {a['layers']} DSv4-Flash-shape layers ({a['routed_experts']} routed experts)", "",
                  f"cold {a['apply_s']['cold']} s, warm (kernels cached) {a['apply_s']['warm']} s; "
                  f"{a['structures']} layer group(s) in the report (one plan per layer structure).", ""]  # fmt: skip
        if "layers_fused" in a:
            lines += [f"{a['layers_fused']} of {a['layers']} layers fused ({a['launches'][0]} -> {a['launches'][1]} glue launches "
                      f"a step); left eager: {a['layers_eager'] or 'none'}; tokens left out of a layer's check as router "
                      f"near ties: {a['near_ties'] or 'none'}.", ""]  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line: ``models`` and ``variants`` as lists (variants in table order),
    ``batches`` a tuple of ints; an unknown name or a batch that is no positive int is refused."""
    parser = argparse.ArgumentParser(description="A decode step of CausalLMs, eager / torch.compile / fuser variants.")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--prefix", type=int, default=PREFIX, help="tokens in each sequence's cache before the step")
    parser.add_argument("--apply-time", action="store_true")
    parser.add_argument("--out", default=str(OUT), help="folder of decode.json and decode.md")
    args = parser.parse_args(argv)
    for option, known in (("models", MODELS), ("variants", VARIANTS)):
        names = [n.strip() for n in getattr(args, option).split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            parser.error(f"--{option}: {', '.join(unknown) or 'none given'}; known: {', '.join(known)}")
        setattr(args, option, [n for n in known if n in names] if option == "variants" else names)
    try:
        args.batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        args.batches = ()
    if not args.batches or min(args.batches) < 1:
        parser.error("--batches: positive ints, comma-separated (1,8,32)")
    if args.prefix < 1:
        parser.error("--prefix: a positive int")
    return args


def main(argv=None) -> None:
    global PREFIX
    args = parse_args(argv)
    PREFIX = args.prefix
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode.json"
    results = json.loads(path.read_text()) if path.exists() else {"models": {}}
    results.setdefault("models", {})

    def save(record=None):
        if record is not None:
            results["models"][record["model"]] = record
        path.write_text(json.dumps(results, indent=1) + "\n")
        (out / "decode.md").write_text(markdown(results))

    if args.apply_time:
        results["apply_time"] = apply_time()
    else:
        copy_gbps = bench.copy_bandwidth_gbps()
        print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
        for name in args.models:
            run(name, args.batches, args.variants, copy_gbps, save, log=lambda line: print(line, flush=True))
    save()
    print(markdown(results))


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
