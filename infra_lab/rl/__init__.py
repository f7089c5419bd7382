"""Chapter 11: RL post-training at a size a reader can hold. The book's engine does the rollouts
(n samples of a prompt share its KV, each token with its log-probability and weight version), a
torch trainer computes GRPO's loss (DeepSeekMath; Dr. GRPO; REINFORCE with a group baseline) on
the same weights, and the new weights go back to the engine after every step (`sync`). The
rollout and the trainer either take turns in one process or run in two (`layouts`), and each
side's idle time is measured."""
