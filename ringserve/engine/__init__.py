"""The driver side of the engine, in the process that serves: requests and their sequences,
the scheduler and the KV block manager, sampling, detokenization, structured output, and
the executor that starts the ranks (ringserve.worker) and sends them each step.

May import ringserve.worker and everything beneath it; never the server or the CLI.
"""
