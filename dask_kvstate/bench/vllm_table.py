"""The vLLM rows as a Markdown table: each kvstate row beside the baseline a vLLM user
would run instead, and the ratio (rows of :mod:`dask_kvstate.bench.vllm_rows`)."""

from __future__ import annotations


def _ratio(baseline: int, ours: int) -> str:
    return f"{baseline / max(1, ours):.2f}x fewer"


def table(res: dict) -> str:
    t = res["branch_ttft"]
    ag = res["agents"]
    ar = res["arrivals"]
    local, ours, one = ag["vllm_local_prefix_each_worker"], ag["kvstate"], ag["one_engine_both_cores"]
    best_wall = min(local["wall_s"], one["wall_s"])
    lines = [
        f"SmolLM2-135M fp32, vLLM CPU engines, L = {res['length']}, medians (agents rows: of "
        f"{len(ours.get('walls', [0]))} interleaved runs); every kvstate output equal to replay.",
        "",
        "| measure | baseline | kvstate over vLLM | ratio |",
        "|---|---|---|---|",
        f"| TTFT of a branch on the worker without the state | local prefix cache, must prefill: "
        f"{t['vllm_local_prefill_on_b']:.3f} s | {t['kvstate_pull_into_b']:.3f} s | "
        f"{t['vllm_local_prefill_on_b'] / t['kvstate_pull_into_b']:.1f}x lower |",
        f"| same, against a prefix-cache hit on one engine | {t['single_engine_hit']:.3f} s | "
        f"{t['kvstate_pull_into_b']:.3f} s | {t['kvstate_pull_into_b'] / t['single_engine_hit']:.2f}x of the hit |",
        f"| {res['n_agents']} agents, Y = {res['new_tokens']}, wall | best of local prefix cache per worker "
        f"({local['wall_s']:.1f} s) and one engine on both cores ({one['wall_s']:.1f} s) | {ours['wall_s']:.1f} s | "
        f"{best_wall / ours['wall_s']:.2f}x |",
        f"| prompt tokens computed | local prefix cache per worker: {local['computed_prompt_tokens']} | "
        f"{ours['computed_prompt_tokens']} | "
        f"{_ratio(local['computed_prompt_tokens'], ours['computed_prompt_tokens'])} |",
        f"| prompt tokens computed, {res['n_agents']} agents, one engine on both cores | "
        f"{one['computed_prompt_tokens']} | {ours['computed_prompt_tokens']} | "
        f"{_ratio(one['computed_prompt_tokens'], ours['computed_prompt_tokens'])} |",
        f"| mean TTFT, {len(ar['kvstate']['ttfts'])} readers arriving on alternating workers | "
        f"{ar['vllm_local_prefix_each_worker']['mean_ttft_s']:.3f} s | {ar['kvstate']['mean_ttft_s']:.3f} s | "
        f"{ar['vllm_local_prefix_each_worker']['mean_ttft_s'] / ar['kvstate']['mean_ttft_s']:.1f}x lower |",
    ]
    for key, how in (
        ("agents_shared_cores", "both engines given both cores, sharing them (kvstate.vllm.share-cores)"),
        ("agents_shared_cores_unshared", "both engines given both cores, each always on both (share-cores off)"),
    ):
        if key not in res:
            continue
        sh = res[key]
        best_shared = min(sh["local"]["wall_s"], one["wall_s"])
        lines.append(
            f"| {res['n_agents']} agents, {how} | local prefix cache per worker "
            f"{sh['local']['wall_s']:.1f} s; one engine on both cores {one['wall_s']:.1f} s | "
            f"{sh['kvstate']['wall_s']:.1f} s | {best_shared / sh['kvstate']['wall_s']:.2f}x |"
        )
    if "kvstate_over_transformers" in ag:
        hf = ag["kvstate_over_transformers"]
        lines.append(
            f"| {res['n_agents']} agents, kvstate over transformers (2 workers x 1 thread, shared-prefix attention) | "
            f"best of local prefix cache per worker ({local['wall_s']:.1f} s) and one engine on both cores "
            f"({one['wall_s']:.1f} s) | {hf['wall_s']:.1f} s ({hf['computed_prompt_tokens']} prompt tokens; "
            f"{hf['same_as_vllm']} of {res['n_agents']} outputs equal to vLLM's) | {best_wall / hf['wall_s']:.2f}x |"
        )
    if "transfer" in res:
        tr = res["transfer"]
        lines.append(
            f"| KV of the state ({tr['mib']:.0f} MiB), A to B | Dask's own fetch of the same bytes: "
            f"{tr['mib'] / tr['raw_s']:.0f} MiB/s | pull {tr['mib'] / tr['kv_s']:.0f} MiB/s; copy into the engine "
            f"{tr['engine_load_mib'] / max(tr['engine_load_s'], 1e-9):.0f} MiB/s | pull at {100 * tr['ratio']:.0f}% "
            f"of Dask's fetch, pull + engine load at {100 * tr['into_engine_ratio']:.0f}% |"
        )
    return "\n".join(lines) + "\n"
