"""The song job over the stages: captions in the trained format (`captions`), the numerics and the
settings objects (`numerics`, `settings`), the request JSON (`request`), the typed stage results
(`stages`), planning and synthesis overlapped (`overlap`) and the command line's job (`pipeline`)."""
