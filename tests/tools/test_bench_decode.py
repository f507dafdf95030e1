"""benchmarks/bench_decode.py and benchmarks/causal_lms.py, the parts that need no GPU: the weight
bytes a decode step reads (tiny transformers models on the CPU; the benchmark's real-dim models on
the meta device), the roofline arithmetic, the busy time of overlapping kernels, a row from what
was measured, the markdown table, and the command line."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from benchmarks import bench_decode, bench_generate, causal_lms
from benchmarks.causal_lms import experts_read, is_routed, roofline_share, roofline_us, weight_bytes
from fuser.tools.capture import busy_us, exposed_us

DENSE = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)  # fmt: skip


def tiny_llama(tied: bool):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**DENSE, tie_word_embeddings=tied)).to(torch.bfloat16)


def llama_layer_elements(c) -> int:
    """A Llama decoder layer's weights, from its config: q, k, v, o; gate, up, down; two norms."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size


def test_tied_embedding_is_counted_once_and_read_whole_by_the_lm_head():
    model = tiny_llama(tied=True)
    c = model.config
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = 2 * (c.vocab_size * c.hidden_size + c.num_hidden_layers * llama_layer_elements(c) + c.hidden_size)
    for batch in (1, 7, 2000):  # the one matrix is read whole whatever the batch
        assert weight_bytes(model, batch) == expected
    twice = sum(p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False))
    assert twice - expected == 2 * c.vocab_size * c.hidden_size


def test_untied_input_embedding_counts_the_rows_looked_up():
    model = tiny_llama(tied=False)
    c = model.config
    others = c.vocab_size * c.hidden_size + c.num_hidden_layers * llama_layer_elements(c) + c.hidden_size  # lm_head whole
    assert weight_bytes(model, 1) == 2 * (others + c.hidden_size)
    assert weight_bytes(model, 5) == 2 * (others + 5 * c.hidden_size)
    assert weight_bytes(model, 5000) == 2 * (others + c.vocab_size * c.hidden_size)  # never more rows than the vocab


def tiny_moe():
    cfg = Qwen3MoeConfig(vocab_size=500, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


@pytest.mark.parametrize("batch, read", [(1, 2), (3, 6), (4, 8), (100, 8)])
def test_moe_counts_the_routed_experts_a_step_reads(batch, read):
    model = tiny_moe()
    c = model.config
    q, kv, h = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size
    attention = h * (2 * q + 2 * kv) + 2 * c.head_dim  # q, k, v, o and the per-head q and k norms
    router, expert = c.num_experts * h, 3 * h * c.moe_intermediate_size  # an expert: gate, up, down
    layer = attention + router + read * expert + 2 * h
    assert experts_read(c, batch) == (read, 8)
    assert weight_bytes(model, batch) == 2 * (c.vocab_size * h + c.num_hidden_layers * layer + h)


def test_dense_models_have_no_routed_experts():
    assert experts_read(tiny_llama(tied=True).config, 8) is None


def test_routed_expert_parameters_are_those_under_a_module_named_experts():
    assert is_routed("model.layers.0.mlp.experts.gate_up_proj")  # transformers' stacked experts
    assert is_routed("model.layers.3.block_sparse_moe.experts.5.w1.weight")  # a list of expert modules
    assert not is_routed("model.layers.0.mlp.shared_experts.gate_proj.weight")
    assert not is_routed("model.layers.0.mlp.gate.weight")
    assert not is_routed("model.experts")  # a parameter named so, not under such a module


def test_llama_1b_has_the_dims_and_the_parameter_count_of_llama_3_2_1b():
    model = causal_lms.causal_lm("llama_1b", device="meta")
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (16, 2048, 8192, 128256)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 64)
    assert c.rope_parameters["rope_theta"] == 500000.0 and c.rope_parameters["rope_type"] == "default"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert weight_bytes(model, 1) == weight_bytes(model, 128) == 2 * 1_235_814_400  # Llama-3.2-1B: 1.24B parameters


def test_deepseek_v4_flash_reads_top_k_per_token_of_its_routed_experts():
    model = causal_lms.causal_lm("deepseek_v4_flash", device="meta")
    c = model.config
    assert c.n_routed_experts == 64 and c.num_experts_per_tok == 6
    one_expert = 3 * c.hidden_size * c.moe_intermediate_size * 2  # bytes: gate, up, down in bf16
    by_batch = {b: weight_bytes(model, b) for b in (1, 2, 10, 11, 128)}
    assert by_batch[2] - by_batch[1] == c.num_hidden_layers * 6 * one_expert + c.hidden_size * 2  # 6 more, one more row
    assert by_batch[11] - by_batch[10] == c.num_hidden_layers * 4 * one_expert + c.hidden_size * 2  # 60 -> 64: capped
    assert by_batch[128] - by_batch[11] == 117 * c.hidden_size * 2  # all 64 read: only the embedding rows grow


def test_bench_generate_builds_its_models_from_the_shared_definitions():
    assert bench_generate.MODELS is causal_lms.MODELS
    assert bench_decode.MODELS is causal_lms.MODELS


def test_roofline_arithmetic():
    assert roofline_us(4_000_000_000, 4000.0) == pytest.approx(1000.0)  # 4 GB at 4 TB/s: 1 ms
    assert roofline_share(4_000_000_000, 4000.0, 2000.0) == pytest.approx(0.5)
    assert roofline_share(2_471_628_800, 4200.0, 588.483) == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize(
    "intervals, busy",
    [
        ([], 0.0),
        ([(0, 10), (20, 25)], 15.0),  # apart
        ([(0, 10), (5, 15)], 15.0),  # overlapping
        ([(0, 30), (5, 10), (12, 20)], 30.0),  # inside another
        ([(0, 10), (10, 20)], 20.0),  # touching
        ([(40, 50), (0, 10), (8, 12), (45, 60)], 32.0),  # out of order
        ([("gemm", 0.0, 10.0), ("norm", 5.0, 12.0)], 12.0),  # (name, start, end) as replay_kernels gives them
    ],
)
def test_busy_time_is_the_union_of_kernel_intervals(intervals, busy):
    assert busy_us(intervals) == pytest.approx(busy)


def test_a_row_from_two_traced_replays():
    # Two replays 100 µs apart; in each a GEMM (0-40), a glue kernel launched early (programmatic
    # dependent launch: 30-50, its first 10 µs waiting on the GEMM) and one after (60-65): 55 µs
    # busy per replay, of which the glue adds 10 + 5.
    kernels = [(n, s + r * 100, e + r * 100) for r in range(2) for n, s, e in (("gemm", 0, 40), ("add", 30, 50), ("norm", 60, 65))]
    glue = exposed_us(kernels[1:3])
    assert glue == [("add", 20.0), ("norm", 5.0)]  # alone, the add's whole interval is its own
    glue = [g for g in exposed_us(kernels[:3]) if g[0] != "gemm"]
    assert glue == [("add", 10.0), ("norm", 5.0)]
    row = bench_decode.timing_row("fuser", 8, 100.0, glue, 1, kernels, 2, 4_000_000_000, 80_000.0, note="")
    assert row["busy_us"] == 55.0 and row["idle_us"] == 45.0
    assert row["glue_us"] == 15.0 and row["glue_launches"] == 2
    assert row["heavy_us"] == 40.0 and row["heavy_launches"] == 1  # 55 µs busy, 15 of them glue
    assert row["glue_share"] == pytest.approx(15 / 55, abs=1e-3)
    assert row["roofline_us"] == 50.0 and row["roofline_share"] == 0.5  # 4 GB at 80 TB/s over a 100 µs step
    assert row["tokens_per_s"] == 80_000
    assert row["top_glue"] == {"add": 10.0, "norm": 5.0}


@pytest.mark.parametrize("kernels", [
    [("a", 0.0, 10.0), ("b", 20.0, 25.0)],
    [("a", 0.0, 10.0), ("b", 5.0, 15.0), ("c", 12.0, 13.0)],
    [("a", 0.0, 30.0), ("b", 5.0, 10.0), ("c", 12.0, 40.0)],
    [("c", 45.0, 60.0), ("a", 0.0, 10.0), ("b", 8.0, 12.0)],
])  # fmt: skip
def test_exposed_times_sum_to_the_busy_time(kernels):
    assert sum(us for _, us in exposed_us(kernels)) == pytest.approx(busy_us(kernels))
    assert all(us >= 0 for _, us in exposed_us(kernels))


def fake_results() -> dict:
    stamp = dict(gpu="NVIDIA H200", torch="2.11", triton="3.6", commit="abc1234")
    new = dict(model="llama_1b", layers=16, stamp=stamp, copy_gbps=4100, apply_s={"fuser": 30.5, "fuser -merge_projections": 12.0},
               apply_failed={}, rows=[
                   dict(variant="eager", batch=1, step_us=2000.0, tokens_per_s=500, busy_us=1500.0, idle_us=500.0, heavy_us=1200.0,
                        heavy_launches=112, glue_us=300.0, glue_launches=290, glue_share=0.2, weight_bytes=2_471_628_800,
                        roofline_us=602.8, roofline_share=0.301, compile_s=None),
                   dict(variant="compile", batch=1, failed="RuntimeError: no", compile_s=None),
                   dict(variant="fuser", batch=1, step_us=700.0, tokens_per_s=1429, busy_us=680.0, idle_us=20.0, heavy_us=640.0,
                        heavy_launches=80, glue_us=40.0, glue_launches=33, glue_share=0.059, weight_bytes=2_471_628_800,
                        roofline_us=602.8, roofline_share=0.861, compile_s=None),
               ])  # fmt: skip
    old = dict(model="qwen3_8b", layers=4, stamp=stamp, apply_s=27.7, rows=[  # a record of the one-fuser format
        dict(variant="compile", batch=1, step_us=927.6, tokens_per_s=1078, glue_launches=42, heavy_launches=50, glue_us=83.2,
             glue_share=0.09, compile_s=11.5)])  # fmt: skip
    return {"models": {"llama_1b": new, "qwen3_8b": old}}


def table_rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| ")]


def test_the_markdown_table():
    md = bench_decode.markdown(fake_results())
    new, old = md.split("\n## ")[1:]
    assert new.startswith("llama_1b (16 layers") and old.startswith("qwen3_8b (4 layers")
    rows = table_rows(new)
    header = rows[0]
    assert header == list(bench_decode.COLUMNS)
    assert all(len(r) == len(header) for r in rows + table_rows(old)), [r for r in rows if len(r) != len(header)]
    by = {r[1]: dict(zip(header, r)) for r in rows[1:]}
    assert list(by) == ["eager", "compile", "fuser"]
    fused = by["fuser"]
    assert (fused["step µs"], fused["busy µs"], fused["idle µs"]) == ("700.0", "680.0", "20.0")
    assert (fused["heavy µs"], fused["heavy launches"], fused["glue µs"], fused["glue launches"]) == ("640.0", "80", "40.0", "33")
    assert (fused["glue share"], fused["roofline"], fused["compile s"]) == ("6%", "86%", "-")
    assert by["eager"]["roofline"] == "30%"
    assert by["compile"]["step µs"] == "failed: RuntimeError: no"
    assert "fuser.apply: fuser 30.5 s; fuser -merge_projections 12.0 s." in new
    assert "4100 GB/s" in new and "batch 1: 2.47 GB, 603 µs" in new
    (row,) = table_rows(old)[1:]  # the old record's row: its new cells "-"
    assert row[:4] == ["1", "compile", "927.6", "1078"] and row[4:7] == ["-", "-", "-"]
    assert row[7:] == ["50", "83.2", "42", "9%", "-", "11.5"]
    assert "fuser.apply: 27.7 s." in old and "GB/s" not in old


def test_command_line():
    args = bench_decode.parse_args([])
    assert args.models == list(causal_lms.MODELS) and args.batches == (1, 8, 32, 128)
    assert args.variants == list(bench_decode.VARIANTS)
    args = bench_decode.parse_args(["--models", "llama_1b", "--batches", "1,32", "--variants", "fuser -merge_projections,eager"])
    assert args.models == ["llama_1b"] and args.batches == (1, 32)
    assert args.variants == ["eager", "fuser -merge_projections"]  # table order
    for bad in (["--models", "llama_8b"], ["--variants", "fuser,pdl"], ["--batches", "1,x"], ["--batches", "0"]):
        with pytest.raises(SystemExit):
            bench_decode.parse_args(bad)


def test_each_fuser_variant_is_a_name_and_apply_options():
    names = [name for name, _ in bench_decode.FUSER_VARIANTS]
    assert names[0] == "fuser" and bench_decode.FUSER_VARIANTS[0][1] == {}
    assert ("fuser -merge_projections", {"disable_passes": ("merge_projections",)}) in bench_decode.FUSER_VARIANTS
    assert len(set(names)) == len(names)
    from fuser.pipeline.pass_list import switched_off

    for _, options in bench_decode.FUSER_VARIANTS:  # every pass named is one fuser can switch off
        switched_off(options.get("disable_passes", ()))


def test_results_are_written_after_every_row(tmp_path, monkeypatch):
    written = []

    def fake_run(name, batches, variants, copy_gbps, save, log):
        record = fake_results()["models"]["llama_1b"]
        rows, record["rows"] = record["rows"], []
        for row in rows:
            record["rows"].append(row)
            save(record)
            written.append(len(json.loads((tmp_path / "decode.json").read_text())["models"]["llama_1b"]["rows"]))
            assert (tmp_path / "decode.md").read_text().count("| 1 |") == len(record["rows"])
        return record

    monkeypatch.setattr(bench_decode, "run", fake_run)
    monkeypatch.setattr(bench_decode.bench, "copy_bandwidth_gbps", lambda: 4100.0)
    bench_decode.main(["--models", "llama_1b", "--batches", "1", "--out", str(tmp_path)])
    assert written == [1, 2, 3]


def test_top_kernels_are_each_names_time_and_launches_a_step():
    # two replays: a GEMV launched twice a step (4 + 6 µs), the attention once (9), a norm once (1)
    totals = {"gemv": [4.0, 6.0, 4.0, 6.0], "attention": [9.0, 9.0], "norm": [1.0, 1.0]}
    assert bench_decode.top_kernels(totals, 2) == {"gemv": [10.0, 2.0], "attention": [9.0, 1.0], "norm": [1.0, 1.0]}
    assert list(bench_decode.top_kernels(totals, 2, count=2)) == ["gemv", "attention"]
