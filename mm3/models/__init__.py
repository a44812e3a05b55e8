"""The MM3 models, one per file, built from a component's hyper-parameters through an `ops` namespace."""
