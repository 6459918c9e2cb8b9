"""Published GPU peak-memory figures of torchtune's recipes, against the memory
estimate (``python -m torchtune.training.memory_estimate``) at the same settings.

    python benchmarks/published_memory.py          # estimate the figures not in the .json
    python benchmarks/published_memory.py --fresh  # estimate every figure again
    python benchmarks/published_memory.py report   # the .md from the .json

Every figure below is quoted from the source named with it, with the settings that
source states. Where it leaves a setting open, the figure says what was assumed
(``assumed``). A figure whose settings the estimate cannot reproduce is listed
with the reason (``not_reproduced``) and not estimated. The estimate is never
tuned to a figure: each runs the shipped 0.6.1 config with the overrides listed,
which undo what changed in the config since the figure was measured.

What the published numbers are: torchtune's recipes log ``peak_memory_active``
(the caching allocator's ``active_bytes.all.peak``), ``peak_memory_alloc``
(``torch.cuda.max_memory_allocated``) and ``peak_memory_reserved``
(``max_memory_reserved``). None of the three counts the CUDA context, nor
bitsandbytes' paged optimizer state (CUDA managed memory, outside the caching
allocator), so each figure is compared with the estimated peak minus the paged
state. Until August 2024 (upstream commit d0b89e206) the recipes divided by 10^9
(GB), since then by 2^30 (GiB).
"""

from __future__ import annotations

import json
import sys
from typing import Any, NamedTuple

from memory_estimate import RESULTS, run_estimate

GB = 10**9
GIB = 2**30

TORCHTUNE = "https://github.com/pytorch/torchtune"

#: Where each figure comes from, and how it was measured, as the source says.
SOURCES = {
    "flags": (
        f"{TORCHTUNE}/blob/v0.6.1/README.md, section 'Optimization flags' (added in "
        "commit 1814feb17a90, 2024-11-18): Llama 3.2 3B, full_finetune_single_device, "
        "batch size 2, max sequence length 4096, bf16, one A100, 'Peak Memory Active "
        "(GiB)'; each technique added on top of the previous one, LoRA and QLoRA "
        "without optimizer_in_bwd or 8-bit AdamW; the command of the QLoRA row is "
        "given (packed, compile, chunked cross-entropy, activation checkpointing and "
        "offloading, torch.optim.AdamW)."
    ),
    "llama3.1": (
        f"{TORCHTUNE}/blob/v0.6.1/README.md, section 'Memory and training speed' "
        "(added in commit 30b8519e86d2, 2024-09-24): 'batch size 2 (without gradient "
        "accumulation), a dataset packed to sequence length 2048, and torch compile "
        "enabled', 'Peak Memory per GPU'; the config of each row is not named, nor "
        "which memory statistic."
    ),
    "llama2": (
        f"{TORCHTUNE}/blob/0217d44c2/README.md (commit 0217d44c2, 2024-05-09; in the "
        "README until 2024-09-24): 'Peak Memory per GPU (GB)', Llama2-7B at 'Batch "
        "Size = 4, Seq Length = 2048', Llama2-70B at 'Batch Size = 4, Seq Length = "
        "4096'; the single-device full finetune and the 70B full finetune use "
        "bitsandbytes' PagedAdamW, QLoRA torch compile; config and statistic not "
        "named."
    ),
    "re-measurement": (
        f"{TORCHTUNE}/pull/961 (closed, 2024-05-10): 'tune run full_finetune_single_"
        "device --config recipes/configs/llama2/7B_full_low_memory.yaml batch_size=4' "
        "with every sample padded to 2048 tokens: '20.2 peak memory allocated (and "
        "similar for reserved)', GPU not named; a reviewer's A100 run: '22.3' (GB)."
    ),
    "tutorials": (
        f"{TORCHTUNE}/blob/v0.6.1/docs/source/tutorials/: qlora_finetune.rst (peak "
        "memory reserved in training, llama2/7B_lora_single_device 15.57 GB and "
        "llama2/7B_qlora_single_device 9.29 GB), llama3.rst (llama3/8B_lora_single_"
        "device, 18.5 GB)."
    ),
    "optimizer-in-backward PRs": (
        f"{TORCHTUNE}/pull/527 (2024-03): Llama2 7B single device, PagedAdamW, "
        "optimizer in backward, bf16: 'GPU peak memory allocation: 13.993540096GB, "
        "GPU peak memory reserved: 15.974006784GB'; "
        f"{TORCHTUNE}/pull/1530 (draft, closed, 2024-09): full_finetune_distributed "
        "with llama2/7B_full, 'peak memory is optimized from 31.5GB to 21.2GB'."
    ),
}


class Figure(NamedTuple):
    source: str  # a key of SOURCES
    row: str  # the source's row, in its words
    gpu: str
    published: float
    unit: str  # "GiB" or "GB", as the source prints it
    statistic: str  # active, allocated, reserved or "not stated"
    mode: str  # "plain" or "in-backward": the estimate's peak it compares with
    config: str = ""
    nproc: int = 1
    overrides: tuple[str, ...] = ()
    #: What differs between the measured run and the estimate, or was assumed.
    differs: str = ""
    #: Why it is not estimated (then ``config`` may be empty).
    not_reproduced: str = ""

    @property
    def published_bytes(self) -> float:
        return self.published * (GIB if self.unit == "GiB" else GB)

    @property
    def run_key(self) -> str:
        return " ".join([self.config, f"--nproc {self.nproc}", *self.overrides])


# The flags table: the shipped 3B config (unchanged since the table but for
# comments) with torch AdamW, no in-backward, no activation checkpointing and a
# plain cross-entropy loss, at 2 x 4096 (packing fills every sample); then each
# row turns one setting on.
_3B = "llama3_2/3B_full_single_device"
_3B_PACKED = (
    "batch_size=2",
    "tokenizer.max_seq_len=4096",
    "optimizer=torch.optim.AdamW",
    "optimizer_in_bwd=False",
    "enable_activation_checkpointing=False",
    "loss=torch.nn.CrossEntropyLoss",
)
_3B_CHUNKED = tuple(o for o in _3B_PACKED if not o.startswith("loss="))
_3B_AC = tuple(o for o in _3B_CHUNKED if not o.startswith("enable_activation"))
_3B_ADAPTERS = ("batch_size=2", "tokenizer.max_seq_len=4096")
_COMPILED = "compiled run; the estimate counts the eager step"

FIGURES = [
    Figure(
        "flags",
        "Baseline",
        "1x A100",
        25.5,
        "GiB",
        "active",
        "plain",
        not_reproduced="unpacked alpaca samples: the lengths of the longest batch "
        "of the epoch are not stated",
    ),
    Figure(
        "flags",
        "+ Packed Dataset",
        "1x A100",
        60.0,
        "GiB",
        "active",
        "plain",
        _3B,
        1,
        _3B_PACKED,
        "optimizer assumed torch.optim.AdamW with its defaults (the '+ 8-bit AdamW' "
        "row comes later); packing's per-document attention mask not modelled "
        "(causal attention over 4096 tokens)",
    ),
    Figure(
        "flags",
        "+ Compile",
        "1x A100",
        51.0,
        "GiB",
        "active",
        "plain",
        _3B,
        1,
        _3B_PACKED,
        _COMPILED,
    ),
    Figure(
        "flags",
        "+ Chunked Cross Entropy",
        "1x A100",
        42.9,
        "GiB",
        "active",
        "plain",
        _3B,
        1,
        _3B_CHUNKED,
        _COMPILED,
    ),
    Figure(
        "flags",
        "+ Activation Checkpointing",
        "1x A100",
        24.9,
        "GiB",
        "active",
        "plain",
        _3B,
        1,
        _3B_AC,
        _COMPILED,
    ),
    Figure(
        "flags",
        "+ Fuse optimizer step into backward",
        "1x A100",
        23.1,
        "GiB",
        "active",
        "in-backward",
        _3B,
        1,
        _3B_AC,
        _COMPILED,
    ),
    Figure(
        "flags",
        "+ Activation Offloading",
        "1x A100",
        21.8,
        "GiB",
        "active",
        "in-backward",
        _3B,
        1,
        _3B_AC,
        _COMPILED + "; offloaded activations are counted on the GPU (an upper bound)",
    ),
    Figure(
        "flags",
        "+ 8-bit AdamW",
        "1x A100",
        17.6,
        "GiB",
        "active",
        "in-backward",
        _3B,
        1,
        tuple(o for o in _3B_AC if not o.startswith("optimizer=")),
        _COMPILED + "; offloading as above; the 8-bit AdamW not named: read as "
        "the config's own bitsandbytes PagedAdamW8bit (paged: not counted)",
    ),
    Figure(
        "flags",
        "+ 8-bit AdamW",
        "1x A100",
        17.6,
        "GiB",
        "active",
        "in-backward",
        _3B,
        1,
        _3B_AC[:2] + ("optimizer=torchao.optim.AdamW8bit",) + _3B_AC[3:],
        _COMPILED + "; offloading as above; the 8-bit AdamW read as torchao's "
        "AdamW8bit, the tutorial's other suggestion (its state is counted)",
    ),
    Figure(
        "flags",
        "LoRA",
        "1x A100",
        8.5,
        "GiB",
        "active",
        "plain",
        "llama3_2/3B_lora_single_device",
        1,
        _3B_ADAPTERS + ("optimizer=torch.optim.AdamW",),
        _COMPILED + "; offloading as above; the command given is the QLoRA row's, "
        "this one assumed the same with the LoRA config",
    ),
    Figure(
        "flags",
        "QLoRA",
        "1x A100",
        4.6,
        "GiB",
        "active",
        "plain",
        "llama3_2/3B_qlora_single_device",
        1,
        _3B_ADAPTERS + ("optimizer=torch.optim.AdamW",),
        _COMPILED + "; offloading as above",
    ),
    Figure(
        "llama3.1",
        "Llama 3.1 8B, Full finetune",
        "1x RTX 4090",
        18.9,
        "GiB",
        "not stated",
        "in-backward",
        "llama3_1/8B_full_single_device",
        1,
        ("batch_size=2", "tokenizer.max_seq_len=2048"),
        _COMPILED + "; config assumed the shipped single-device one (PagedAdamW8bit, "
        "in-backward, activation checkpointing), the only full config that fits 24 GB",
    ),
    Figure(
        "llama3.1",
        "Llama 3.1 8B, Full finetune",
        "1x A6000",
        37.4,
        "GiB",
        "not stated",
        "plain",
        not_reproduced="its settings, other than the 4090 row's, are not stated",
    ),
    Figure(
        "llama3.1",
        "Llama 3.1 8B, LoRA",
        "1x RTX 4090",
        16.2,
        "GiB",
        "not stated",
        "plain",
        "llama3_1/8B_lora_single_device",
        1,
        (
            "batch_size=2",
            "tokenizer.max_seq_len=2048",
            "model.lora_attn_modules=[q_proj,v_proj]",
            "model.apply_lora_to_mlp=False",
        ),
        _COMPILED + "; LoRA layers as in the config of the time (q and v only)",
    ),
    Figure(
        "llama3.1",
        "Llama 3.1 8B, LoRA",
        "1x A6000",
        30.3,
        "GiB",
        "not stated",
        "plain",
        not_reproduced="its settings, other than the 4090 row's, are not stated",
    ),
    Figure(
        "llama3.1",
        "Llama 3.1 8B, QLoRA",
        "1x RTX 4090",
        7.4,
        "GiB",
        "not stated",
        "plain",
        "llama3_1/8B_qlora_single_device",
        1,
        (
            "batch_size=2",
            "tokenizer.max_seq_len=2048",
            "model.lora_attn_modules=[q_proj,v_proj,k_proj,output_proj]",
        ),
        _COMPILED + "; LoRA layers as in the config of the time",
    ),
    Figure(
        "llama3.1",
        "Llama 3.1 70B, Full finetune",
        "8x A100",
        13.9,
        "GiB",
        "not stated",
        "plain",
        not_reproduced="CPU offload with a fused optimizer: the estimate counts "
        "offloaded parameters and state on the GPU",
    ),
    Figure(
        "llama3.1",
        "Llama 3.1 70B, LoRA",
        "8x A100",
        27.6,
        "GiB",
        "not stated",
        "plain",
        "llama3_1/70B_lora",
        8,
        (
            "batch_size=2",
            "tokenizer.max_seq_len=2048",
            "model.lora_attn_modules=[q_proj,k_proj,v_proj]",
            "model.apply_lora_to_mlp=False",
        ),
        _COMPILED + "; LoRA layers as in the config of the time",
    ),
    Figure(
        "llama3.1",
        "Llama 3.1 405B, QLoRA",
        "8x A100",
        44.8,
        "GB",
        "not stated",
        "plain",
        not_reproduced="not estimated here: the 405B QLoRA config over 8 ranks "
        "was not run on this 2-core machine",
    ),
    Figure(
        "llama2",
        "1 x RTX 4090, Full finetune (PagedAdamW)",
        "1x RTX 4090",
        24.1,
        "GB",
        "not stated",
        "in-backward",
        "llama2/7B_full_low_memory",
        1,
        (
            "batch_size=4",
            "tokenizer.max_seq_len=2048",
            "loss=torch.nn.CrossEntropyLoss",
            "enable_activation_offloading=False",
        ),
        "config of the time: plain cross-entropy, no activation offloading; "
        "samples assumed full length",
    ),
    Figure(
        "re-measurement",
        "7B_full_low_memory batch_size=4, samples of 2048",
        "not stated",
        20.2,
        "GB",
        "allocated",
        "in-backward",
        "llama2/7B_full_low_memory",
        1,
        (
            "batch_size=4",
            "tokenizer.max_seq_len=2048",
            "loss=torch.nn.CrossEntropyLoss",
            "enable_activation_offloading=False",
        ),
        "config of the time, as above",
    ),
    Figure(
        "re-measurement",
        "the same, a reviewer's run",
        "1x A100",
        22.3,
        "GB",
        "not stated",
        "in-backward",
        "llama2/7B_full_low_memory",
        1,
        (
            "batch_size=4",
            "tokenizer.max_seq_len=2048",
            "loss=torch.nn.CrossEntropyLoss",
            "enable_activation_offloading=False",
        ),
        "config of the time, as above",
    ),
    Figure(
        "llama2",
        "4 x RTX 4090, Full finetune",
        "4x RTX 4090",
        24.1,
        "GB",
        "not stated",
        "plain",
        "llama2/7B_full",
        4,
        (
            "batch_size=4",
            "tokenizer.max_seq_len=2048",
            "loss=torch.nn.CrossEntropyLoss",
            "optimizer.fused=False",
        ),
        "measured with FSDP1 (the recipe of the time), estimated with FSDP2; "
        "config of the time: plain cross-entropy, unfused AdamW",
    ),
    Figure(
        "llama2",
        "1 x RTX 4090, LoRA",
        "1x RTX 4090",
        21.3,
        "GB",
        "not stated",
        "plain",
        "llama2/7B_lora_single_device",
        1,
        (
            "batch_size=4",
            "tokenizer.max_seq_len=2048",
            "loss=torch.nn.CrossEntropyLoss",
            "model.lora_attn_modules=[q_proj,v_proj]",
            "model.apply_lora_to_mlp=False",
        ),
        "config of the time: q and v LoRA, plain cross-entropy",
    ),
    Figure(
        "llama2",
        "2 x RTX 4090, LoRA",
        "2x RTX 4090",
        16.2,
        "GB",
        "not stated",
        "plain",
        "llama2/7B_lora",
        2,
        (
            "batch_size=4",
            "tokenizer.max_seq_len=2048",
            "loss=torch.nn.CrossEntropyLoss",
            "model.lora_attn_modules=[q_proj,v_proj]",
            "model.apply_lora_to_mlp=False",
        ),
        "measured with FSDP1, estimated with FSDP2; config of the time as above "
        "(no activation checkpointing)",
    ),
    Figure(
        "llama2",
        "1 x RTX 4090, QLoRA",
        "1x RTX 4090",
        12.3,
        "GB",
        "not stated",
        "plain",
        "llama2/7B_qlora_single_device",
        1,
        (
            "batch_size=4",
            "tokenizer.max_seq_len=2048",
            "loss=torch.nn.CrossEntropyLoss",
            "model.lora_attn_modules=[q_proj,v_proj,k_proj,output_proj]",
        ),
        _COMPILED + "; config of the time: plain cross-entropy, its LoRA layers",
    ),
    Figure(
        "llama2",
        "8 x A100, LoRA, Llama2-70B",
        "8x A100",
        26.4,
        "GB",
        "not stated",
        "plain",
        "llama2/70B_lora",
        8,
        (
            "batch_size=4",
            "tokenizer.max_seq_len=4096",
            "loss=torch.nn.CrossEntropyLoss",
            "model.lora_attn_modules=[q_proj,v_proj,k_proj]",
            "model.apply_lora_to_mlp=False",
        ),
        "measured with FSDP1, estimated with FSDP2; config of the time: q, k and v "
        "LoRA, plain cross-entropy",
    ),
    Figure(
        "llama2",
        "8 x A100, Full Finetune, Llama2-70B (PagedAdamW)",
        "8x A100",
        70.4,
        "GB",
        "not stated",
        "plain",
        not_reproduced="no Llama2 70B full config is shipped, and its settings "
        "beyond batch and length are not stated",
    ),
    Figure(
        "tutorials",
        "LoRA / QLoRA, Llama2 7B, training",
        "not stated",
        15.57,
        "GB",
        "reserved",
        "plain",
        not_reproduced="unpacked alpaca samples of unstated length (also QLoRA "
        "9.29 GB, llama3.rst's 18.5 GB)",
    ),
    Figure(
        "optimizer-in-backward PRs",
        "Llama2 7B full, PagedAdamW, in-backward",
        "not stated",
        13.99,
        "GB",
        "allocated",
        "in-backward",
        not_reproduced="a March 2024 recipe and config; batch size and sample "
        "lengths not stated",
    ),
    Figure(
        "optimizer-in-backward PRs",
        "llama2/7B_full, in-backward (plain 31.5)",
        "not stated",
        21.2,
        "GB",
        "not stated",
        "in-backward",
        not_reproduced="number of GPUs, batch and sample lengths not stated",
    ),
]


def compare(fig: Figure, est: dict[str, Any]) -> dict[str, Any]:
    """The figure against its estimate: the estimated peak of its mode, without
    the paged state that no torch statistic counts."""
    key = "plain" if fig.mode == "plain" else "in_backward"
    peak = est[key]["peak"]
    comparable = peak["total"] - est["paged_state_bytes"]
    return {
        "estimated": peak["total"],
        "paged_state": est["paged_state_bytes"],
        "comparable": comparable,
        "peak_in": peak["phase"],
        "error": (comparable - fig.published_bytes) / fig.published_bytes,
        "batch_x_tokens": f"{est['batch_size']} x {est['seq_len']}",
        "optimizer": est["optimizer"].rsplit(".", 1)[-1],
        "activation_checkpointing": est["activation_checkpointing"],
    }


def _summary(est: dict[str, Any]) -> dict[str, Any]:
    """What :func:`compare` needs of an estimate (kept in the .json)."""
    keys = ("paged_state_bytes", "batch_size", "seq_len", "optimizer", "wall_s")
    out = {k: est[k] for k in keys}
    out["activation_checkpointing"] = est["activation_checkpointing"]
    for mode in ("plain", "in_backward"):
        peak = est[mode]["peak"]
        out[mode] = {"peak": {"total": peak["total"], "phase": peak["phase"]}}
    return out


def run(estimates: dict[str, Any]) -> dict[str, Any]:
    """Estimate every figure not in ``estimates`` (by config, ranks and
    overrides), and compare."""
    import torch

    rows = []
    for fig in FIGURES:
        row = {**fig._asdict(), "published_bytes": fig.published_bytes}
        if not fig.not_reproduced:
            if fig.run_key not in estimates:
                try:
                    est = run_estimate(fig.config, list(fig.overrides), fig.nproc)
                    print(est["report"], f"\n({est['wall_s']:.0f} s)\n", flush=True)
                    estimates[fig.run_key] = _summary(est)
                except RuntimeError as e:  # reported with the figure, not fatal
                    print(e, flush=True)
                    estimates[fig.run_key] = {"failed": str(e).strip().split("\n")[-1]}
            est = estimates[fig.run_key]
            if "failed" in est:
                row["not_reproduced"] = "the estimate failed: " + est["failed"]
            else:
                row.update(compare(fig, est))
        rows.append(row)
    return {
        "torch": torch.__version__,
        "sources": SOURCES,
        "figures": rows,
        "estimates": estimates,
    }


def _size(n: float, unit: str) -> str:
    return f"{n / (GIB if unit == 'GiB' else GB):.1f}"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Published GPU peak memory of torchtune's recipes vs the memory estimate",
        "",
        "`python benchmarks/published_memory.py` on this project's CPU machine, torch "
        f"{results['torch']}. Each figure is quoted from its source (below) and "
        "compared with the estimate (`python -m torchtune.training.memory_estimate`) "
        "at its settings: the shipped 0.6.1 config and the overrides listed, full-"
        "length samples, the peak of the same mode (plain or in-backward) minus "
        "bitsandbytes' paged optimizer state (CUDA managed memory, which none of "
        "torch's statistics count). Sizes in the source's unit (GiB = 2^30 bytes, "
        "GB = 10^9). The estimate counts the eager step; most figures are of "
        "compiled runs.",
        "",
        "| source | row | GPU | statistic | mode | published | estimated "
        "(paged state) | compared | error | estimated peak in | config, ranks, "
        "overrides | what differs |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results["figures"]:
        if r["not_reproduced"]:
            continue
        u = r["unit"]
        paged = f" ({_size(r['paged_state'], u)})" if r["paged_state"] else ""
        lines.append(
            f"| {r['source']} | {r['row']} | {r['gpu']} | {r['statistic']} "
            f"| {r['mode']} | {r['published']} {u} "
            f"| {_size(r['estimated'], u)}{paged} | {_size(r['comparable'], u)} "
            f"| {r['error']:+.0%} | {r['peak_in']} "
            f"| `{r['config']}`, {r['nproc']}, `{' '.join(r['overrides'])}` "
            f"| {r['differs']} |"
        )
    lines += ["", "Not estimated:", ""]
    for r in results["figures"]:
        if r["not_reproduced"]:
            lines.append(
                f"- {r['source']}, {r['row']} ({r['gpu']}): {r['published']} "
                f"{r['unit']}, {r['statistic']}: {r['not_reproduced']}."
            )
    lines += ["", "Sources:", ""]
    lines += [f"- **{key}**: {text}" for key, text in results["sources"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = RESULTS / "published_memory.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    if argv == ["report"]:
        results = old
    else:
        # --fresh estimates every figure again; without it, only those not in
        # the .json yet.
        results = run({} if "--fresh" in argv else old.get("estimates", {}))
        path.write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (RESULTS / "published_memory.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
