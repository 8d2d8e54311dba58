"""Recovery fine-tuning after pruning: LoRA adapters (peft) trained on recovery text with next-token loss,
distillation from the unpruned model, or both, then merged into the pruned weights. Imports `pruning` (its measured
loss), `sources` and the root modules; pruning never imports it. The sweep runs it as a trial stage between pruning
and evaluation."""
