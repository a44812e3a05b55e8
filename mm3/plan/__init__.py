"""The autoregressive stage, a caption and lyrics to audio codes: the prompt (`prompt`), the codes
(`codes`), the draws (`sampling`, `shaping`), teacher forcing (`replay`), the plan (`ar`), several
takes (`takes`) and lyric timestamps from the LM's attention (`lyrics_align`)."""
