"""Disaggregated prefill/decode of a real transformer through kvxfer (CPU, no downloads).

``python -m examples.disagg_llm`` starts two daemons, a prefill engine process and a decode
engine process, and checks that the decode engine, fed only by KV pulled through kvxfer,
generates the same tokens as one process running the whole request.
"""
