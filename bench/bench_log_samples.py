"""Cost of lm-eval's log_samples=True (the per-item results the held-out split needs) on the shipped tiny-llama:
all 7 world tasks at every item, with and without it, alternating, 3 repetitions each, one process.

    .venv/bin/python bench/bench_log_samples.py
"""
import os
import statistics
import time

os.environ["TQDM_DISABLE"] = "1"
from lm_eval import simple_evaluate

from taylor_tune.config import ZERO_SHOT_TASKS
from taylor_tune.evaluation.scorer import make_lm
from taylor_tune.evaluation.zero_shot import task_source
from taylor_tune.sources.models import load_model, load_tokenizer

m, t = load_model("tiny-llama"), load_tokenizer("tiny-llama")
lm = make_lm(m, t, 16)
times = {True: [], False: []}
for rep in range(3):
    for flag in (False, True):
        start = time.perf_counter()
        for task in ZERO_SHOT_TASKS:
            src, man = task_source(task, "world")
            simple_evaluate(
                model=lm,
                tasks=[src],
                task_manager=man,
                limit=None,
                bootstrap_iters=1000,
                log_samples=flag,
                verbosity="ERROR",
            )
        times[flag].append(time.perf_counter() - start)
print({k: [round(x, 2) for x in v] for k, v in times.items()})
print("median ratio log_samples/no:", statistics.median(times[True]) / statistics.median(times[False]))
