"""LoRA adapters of the language model and the DiT: their file formats (`keys`, `adapter`), how a
request records one (`use`), attaching them to a built model as side products (`attach`), the
health check against the base weights (`health`) and finding a recorded file again (`files`)."""
