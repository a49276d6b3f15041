"""hsq's dump connector for stock vLLM (>= 0.26 with extract_hidden_states).

vLLM loads ``hsq.engines.vllm.connector:HsqConnector`` through ``kv_connector_module_path``;
that module is the only one here that imports vLLM. The rest is pure and tested on a CPU:
the connector's settings (config.py), layer ids (layers.py), start-up refusals
(refusals.py), the final norm read from the checkpoint (checkpoint.py), the dump's
tensors (states.py), the writer into hsq's dump protocol (writer.py) and the launch
command (launch_args.py). docs/vllm.md describes it.
"""
