"""Run one stage of a trial on a random LLaMA-shaped model and print what it added to the process's peak resident
memory (bytes over the resident set just before it, the high-water mark reset there), as JSON: the measurement
`sweep.memory`'s estimate is held to. The stage runs once on a few tokens first, so that the libraries' code it
executes is already resident and not counted as what it allocates.

Run in a fresh process with MALLOC_MMAP_THRESHOLD_ fixed: glibc otherwise raises its mmap threshold after each large
free, so later tensors come from the heap and stay resident after they are freed, and the peak would count that
slack. usage: python -m tests.sweep.memory_probe STAGE DTYPE HIDDEN INTERMEDIATE LAYERS VOCAB BATCH SEQ_LEN

    python -m tests.sweep.memory_probe --each '[[STAGE, DTYPE, HIDDEN, ...], ...]'

measures each run in a process of its own forked from one that has imported the libraries and nothing more: what a
fresh process would measure, without importing torch and transformers once per run. One JSON line per run, in order.
"""

import copy
import gc
import json
import os
import sys
import traceback

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from taylor_tune.config import RecoverySpec, SpeedSpec
from taylor_tune.evaluation.speed import measure_paired
from taylor_tune.pruning.groups import describe_layout
from taylor_tune.pruning.importance import compute_importance
from taylor_tune.pruning.measured import calibration_loss
from taylor_tune.recovery.train import recover


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak() -> int:
    """The resident high-water mark since the last `reset_peak` (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the high-water mark to the present resident set
        f.write("5")


def run(stage: str, model, teacher, layout, ids: torch.Tensor) -> None:
    batch, seq_len = ids.shape
    if stage == "importance":
        compute_importance(model, layout, ids, micro_batch_size=batch)
    elif stage == "calibration_forward":
        with torch.no_grad():
            calibration_loss(model, ids, batch)
    elif stage == "speed":
        unpruned = copy.deepcopy(model)  # loaded by the stage beside the (here unpruned) model it times
        measure_paired(model, unpruned, SpeedSpec(prefill_batch=batch, prefill_len=seq_len, decode_batch=2,
                                                  prompt_len=8, new_tokens=2, repeats=1, warmup=0))
    else:
        loss = stage.removeprefix("recovery_") if stage.startswith("recovery_") else "ce"
        spec = RecoverySpec(steps=2, micro_batch_size=batch, seq_len=seq_len, warmup_steps=0, loss=loss)
        recover(model, torch.randint(0, model.config.vocab_size, (2 * batch, seq_len)), ids[:1], spec,
                teacher=teacher)


def each(runs: list[list]) -> None:
    """Each run in a child forked from this process, which has imported the libraries (at its top) and made no
    tensor yet, so no thread pool is forked; the child's line is printed as it ends."""
    for stage, dtype, *sizes in runs:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read)
            code = 1
            try:
                with os.fdopen(write, "w") as out:
                    sys.stdout = out
                    main(stage, dtype, *map(int, sizes))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)  # never back into the parent's loop
        os.close(write)
        with os.fdopen(read) as got:
            line = got.read().strip()
        _, status = os.waitpid(child, 0)
        if status != 0:
            raise SystemExit(f"{stage} {dtype} {sizes}: the forked run failed (wait status {status})")
        print(line, flush=True)


def main(stage: str, dtype: str, hidden: int, intermediate: int, layers: int, vocab: int, batch: int, seq_len: int):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         vocab_size=vocab, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=4096)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    ids = torch.randint(0, vocab, (batch, seq_len))
    layout = describe_layout(model)
    teacher = copy.deepcopy(model) if stage == "recovery_kd" else None
    # the stage once on a few tokens first: the libraries' code it runs is paged in then, not counted as what the
    # stage allocates (how much of it a first run maps depends on what the page cache holds, so it varies by run)
    run(stage, copy.deepcopy(model), teacher, layout, ids[:1, :8])
    gc.collect()
    reset_peak()
    before = resident()
    run(stage, model, teacher, layout, ids)
    print(json.dumps({"added": peak() - before,
                      "params": sum(p.numel() for p in model.parameters()),
                      "layer_params": sum(layout.layer_params)}))


if __name__ == "__main__":
    if sys.argv[1] == "--each":
        each(json.loads(sys.argv[2]))
    else:
        main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
