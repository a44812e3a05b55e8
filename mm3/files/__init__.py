"""Component files on disk: which components a file holds and opening it (`opener`), a models folder
sorted into the five buckets and the `auto` choice (`registry`), the inventory of published sets
(`inventory`) and the loaded-model store of the command line (`store`)."""
