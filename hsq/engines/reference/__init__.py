"""A server with SGLang's HTTP API and hsq's dump protocol, running a real HF transformer."""
