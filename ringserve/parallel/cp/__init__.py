"""Context parallelism: exact ring attention over a sequence-sharded, persistent KV cache.

Every CP rank holds the whole model (or its TP shard) and the KV of the logical blocks
placed on it (layout.place_blocks: load-balanced 2N chunks for a prefill, round robin
for decode). In a step, rank k computes the new tokens whose blocks it holds, writes
their KV into its cache, and attends them to every visible key of their sequences, wherever
it lies, by one of two rings:

- pass-KV: the KV a rank holds for the batch's sequences travels the ring; each rank
  attends its queries to the block it holds while it sends that block on and receives the
  next (isend/irecv, double-buffered); partials are merged locally by log-sum-exp.
- pass-Q: queries (with positions and sequences) travel; each rank attends them to its own
  KV; the partial outputs and LSEs go home in one all-to-all and are merged there. In a
  decode step (one new token a sequence) a full-attention layer reads the rank's own KV in
  place through its block table (RingAttention.attend_in_place, the paged kernel); other
  steps and windowed layers attend to the rank's keys gathered out of the cache.

Layers with a window (sliding, chunked) run only the ring steps whose pair of ranks shares
a visible key, each block sent straight from its owner (see RingAttention._local_pass_kv).

All ranks derive the same RingStep from the step's CPStep (every rank's new tokens, and
how many keys each rank holds of each sequence), so no sizes are exchanged, and every
message of a ring is padded to the largest rank's.

The modules: layout.py (where each logical block lives: the host's bookkeeping, the
driver's), plan.py (RingStep: the step's plan on every rank), ring.py (RingAttention: the
communication and attention), policy.py (pass-KV or pass-Q, priced per step), calibrate.py
(the measurements the policy prices with).
"""
