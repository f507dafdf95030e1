"""End-to-end decode: transformers CausalLMs at real dims (random weights, a few layers), one
decode step — one new token per sequence, a static KV cache holding a 256-token prefix —
captured in a CUDA graph and replayed: eager vs torch.compile vs fuser.

    PYTHONPATH=. python benchmarks/bench_decode.py [--models qwen3_8b,deepseek_v4_flash] [--batches 1,8,32,128]
    PYTHONPATH=. python benchmarks/bench_decode.py --apply-time   # fuser.apply on 43 DSv4-Flash-shape layers

Every variant runs the same model code on the same weights, from its own copy of one prefilled
cache. torch.compile compiles the model's forward as transformers documents for a static-cache
decode step (``torch.compile(model.forward)``; its own CUDA graphs off, since the step is
captured here as for every variant). fuser fuses once, on a step at batch 8, and serves every
batch. Writes benchmarks/results/decode.{json,md}: step time, tokens/s, glue launches and glue
share of GPU time per step, compile and apply times.
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
from examples.zoo import layers as zoo  # noqa: E402
from fuser.tools import bench  # noqa: E402
from fuser.tools.capture import capture_decode, replay_time_us  # noqa: E402
from fuser.codegen.emit import kernel_dir  # noqa: E402

OUT = ROOT / "benchmarks/results"
PREFIX = 256
ROOM = 96  # cache slots past the prefix: each variant's warm-ups and replays (about 65) write one each
# name -> (zoo model, decoder layers, config overrides)
MODELS = {
    "qwen3_8b": ("qwen3", 4, {}),
    # 64 of the 256 routed experts, so that the weights of 2 layers fit beside three caches
    "deepseek_v4_flash": ("deepseek_v4", 2, {"n_routed_experts": 64}),
}


def causal_lm(name: str, layers: int | None = None, **overrides):
    """The CausalLM at the model's real dims with a few layers, bf16, on the GPU."""
    model, count, changes = MODELS[name]
    cfg = zoo.config(model, "cuda")
    cfg.num_hidden_layers = layers or count
    for key in ("layer_types", "mlp_layer_types"):
        if getattr(cfg, key, None):
            setattr(cfg, key, getattr(cfg, key)[:1] * cfg.num_hidden_layers)
    for key, value in {**changes, **overrides}.items():
        setattr(cfg, key, value)
    if model == "deepseek_v4":
        cfg._attn_implementation = "eager"  # transformers' DeepseekV4ForCausalLM takes no sdpa
    if "moe" not in model and "deepseek" not in model:
        cfg._experts_implementation = None
    spec = zoo.MODELS[model]
    code = __import__(f"transformers.models.{spec['module']}", fromlist=["_"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = getattr(code, spec["prefix"] + "ForCausalLM")(cfg)
    return lm.to(torch.bfloat16).eval()


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


def measure(variant: str, forward, batch: int) -> dict:
    capture = capture_decode(forward, lambda bs: (), [batch], variant=variant)
    if batch not in capture.graphs:
        return dict(variant=variant, batch=batch, failed=capture.failed.get(batch))
    graph = capture.graphs[batch].graph
    step_us = replay_time_us(graph)
    classes = bench.kernel_classes(forward, (), heavy_calls=variant != "compile")
    glue, heavy, note, _ = bench.profile_replay(graph, classes)
    glue_us = sum(us for _, us in glue)
    gpu_us = sum(us for _, us in _replayed(graph))
    by_name: dict[str, float] = {}
    for name, us in glue:
        by_name[name[:80]] = by_name.get(name[:80], 0.0) + us
    top = dict(sorted(((n, round(us, 1)) for n, us in by_name.items()), key=lambda x: -x[1])[:8])
    return dict(variant=variant, batch=batch, step_us=round(step_us, 1), tokens_per_s=round(batch / step_us * 1e6),
                glue_launches=len(glue), heavy_launches=heavy, glue_us=round(glue_us, 1),
                glue_share=round(glue_us / gpu_us, 3) if gpu_us else None, note=note, top_glue=top,
                glue_order=[name[:60] for name, _ in glue])  # fmt: skip


def _replayed(graph) -> list[tuple[str, float]]:
    """Every kernel of one replay, (name, µs)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return bench._kernels(prof)


def run(name: str, batches: tuple[int, ...], save=lambda record: None) -> dict:
    """The model's rows, batch by batch (``save`` is called with the record after each)."""
    model = causal_lm(name)
    compiled_model = sharing_weights(model)
    fused_model = sharing_weights(model)
    compiled_forward = torch.compile(compiled_model.forward, dynamic=False)
    record = dict(model=name, layers=model.config.num_hidden_layers, stamp=bench.stamp(), rows=[])
    cache, tokens = prefilled(model, 8)
    started = time.perf_counter()
    report = fuser.apply(fused_model, (), example_kwargs=step(model, tokens, copy.deepcopy(cache)))
    record["apply_s"] = round(time.perf_counter() - started, 1)
    record["fuser_report"] = report.text()
    del cache
    for batch in batches:
        cache, tokens = prefilled(model, batch)
        for variant, module in (("eager", model), ("compile", None), ("fuser", fused_model)):
            kwargs = step(model, tokens, copy.deepcopy(cache))
            if variant == "compile":
                forward = functools.partial(compiled_forward, **kwargs)
                torch.cuda.synchronize()
                started = time.perf_counter()
                with torch.no_grad():
                    forward()
                torch.cuda.synchronize()
                compile_s = round(time.perf_counter() - started, 1)
            else:
                forward, compile_s = functools.partial(module, **kwargs), None
            row = measure(variant, forward, batch)
            row["compile_s"] = compile_s
            print(row, flush=True)
            record["rows"].append(row)
        save(record)
        del cache
        torch.cuda.empty_cache()
    return record


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


def markdown(results: dict) -> str:
    lines = ["# Decode step, end to end: eager / torch.compile / fuser", ""]
    for name, record in results.get("models", {}).items():
        s = record["stamp"]
        lines += [
            f"## {name} ({record['layers']} layers, real dims, bf16, static cache of {PREFIX} tokens)",
            "",
            f"{s['gpu']}, torch {s['torch']}, triton {s['triton']}, commit {s['commit']}. fuser.apply: {record['apply_s']} s.",
            "",
            "| batch | variant | step µs | tokens/s | glue launches | glue µs | glue share | compile s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in record["rows"]:
            if r.get("failed"):
                lines.append(f"| {r['batch']} | {r['variant']} | failed: {r['failed']} | | | | | |")
                continue
            compile_s = r["compile_s"] if r["compile_s"] is not None else "-"
            lines.append(f"| {r['batch']} | {r['variant']} | {r['step_us']} | {r['tokens_per_s']} | {r['glue_launches']} | "
                         f"{r['glue_us']} | {r['glue_share']:.0%} | {compile_s} |")  # fmt: skip
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


if __name__ == "__main__":
    os.chdir(ROOT)
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--apply-time", action="store_true")
    args = parser.parse_args()
    path = OUT / "decode.json"
    results = json.loads(path.read_text()) if path.exists() else {"models": {}}
    if args.apply_time:
        results["apply_time"] = apply_time()
    else:
        def save(record):
            results["models"][record["model"]] = record
            path.write_text(json.dumps(results, indent=1) + "\n")

        for name in args.models.split(","):
            run(name, tuple(int(b) for b in args.batches.split(",")), save)
    path.write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "decode.md").write_text(markdown(results))
    print(markdown(results))
