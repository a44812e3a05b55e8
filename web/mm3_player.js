// The live player of the MM3 nodes that decode audio (Vocoder Decode, Generate): each window's audio
// arrives as the engine decodes it (the "mm3.window" event names a 32-bit float WAV in ComfyUI's temp
// folder) and is scheduled on one Web Audio clock right after the previous one, so the song plays
// without gaps while it is still being made; a waveform drawn as the windows arrive, the position, and
// optional LRC lyrics ("[mm:ss.xx]line") with the current line lit and click-to-seek (a click also
// hands the line or section to `onChoose`: the editor sets the range of its Repaint nodes). A volume slider;
// a song from a vocoder with random weights (a tiny test model: full-scale noise) is said to be noise
// and played at a tenth of the volume.
//
// The parts that decide what plays when (WAV reading, LRC parsing, the schedule, seeking) are plain
// functions and a class over an injected AudioContext, so they run under node.js in the tests.

export const LEAD = 0.05; // seconds between a start asked for and the clock: room for the audio thread
export const PEAKS_PER_SECOND = 50; // waveform resolution
export const WAVE_HEIGHT = 40; // pixels of the waveform
export const LYRICS_HEIGHT = 96; // pixels of the lyric lines (shown with an LRC text)
export const PLAYER_HEIGHT = 76; // the widget without lyrics: the controls and the waveform
export const NOTE_HEIGHT = 36; // pixels of the line that says a song is noise
export const QUIET = 0.1; // the gain of noise from random weights, times the volume slider's
export const NOISE_NOTE = "Noise: this vocoder has random weights (a tiny test model), so it is played quietly. " +
  "The real model files make music (MM3 models sidebar).";

// -- WAV ----------------------------------------------------------------------------------------
// A RIFF WAVE file (32-bit float or 16-bit PCM, any channel count) -> { sampleRate, channels: [Float32Array] }.
export function readWav(bytes) {
  const view = new DataView(bytes instanceof ArrayBuffer ? bytes : bytes.buffer, bytes.byteOffset ?? 0,
                            bytes.byteLength);
  const tag = (at) => String.fromCharCode(...[0, 1, 2, 3].map((i) => view.getUint8(at + i)));
  if (tag(0) !== "RIFF" || tag(8) !== "WAVE") throw new Error("not a WAV file");
  let at = 12, format = null, data = null;
  while (at + 8 <= view.byteLength) {
    const id = tag(at), size = view.getUint32(at + 4, true);
    if (id === "fmt ") {
      format = { code: view.getUint16(at + 8, true), channels: view.getUint16(at + 10, true),
                 rate: view.getUint32(at + 12, true), bits: view.getUint16(at + 22, true) };
      if (format.code === 0xfffe && size >= 40) format.code = view.getUint16(at + 32, true); // extensible
    } else if (id === "data") {
      data = { at: at + 8, size: Math.min(size, view.byteLength - at - 8) };
    }
    at += 8 + size + (size & 1);
  }
  if (!format || !data) throw new Error("WAV without fmt or data");
  const float = format.code === 3 && format.bits === 32, pcm = format.code === 1 && format.bits === 16;
  if (!float && !pcm) throw new Error(`unsupported WAV format ${format.code}/${format.bits} bits`);
  const width = format.bits / 8, frames = Math.floor(data.size / (width * format.channels));
  const channels = Array.from({ length: format.channels }, () => new Float32Array(frames));
  for (let i = 0; i < frames; i++) {
    for (let c = 0; c < format.channels; c++) {
      const p = data.at + (i * format.channels + c) * width;
      channels[c][i] = float ? view.getFloat32(p, true) : view.getInt16(p, true) / 32768;
    }
  }
  return { sampleRate: format.rate, channels };
}

// -- LRC ----------------------------------------------------------------------------------------
// Standard LRC text -> [{ time (s), text }] sorted by time: "[mm:ss.xx]line" (also [mm:ss], [mm:ss.x..]
// and [mm:ss:xx]), several stamps on one line each give it, [offset:+/-ms] shifts every line (a positive
// offset shows lines sooner), other [tag:...] lines and unstamped lines are left out.
export function parseLrc(text) {
  const lines = [];
  let offset = 0;
  const stamp = /\[(\d+):(\d{1,2})(?:[.:](\d{1,3}))?\]/g;
  for (const raw of String(text ?? "").split(/\r?\n/)) {
    const meta = raw.match(/^\s*\[offset:\s*([+-]?\d+)\s*\]\s*$/i);
    if (meta) {
      offset = Number(meta[1]) / 1000;
      continue;
    }
    const times = [];
    let rest = raw.trimStart(), m;
    stamp.lastIndex = 0;
    while ((m = stamp.exec(rest)) && m.index === 0) {
      const frac = m[3] ? Number(m[3]) / 10 ** m[3].length : 0;
      times.push(Number(m[1]) * 60 + Number(m[2]) + frac);
      rest = rest.slice(m[0].length);
      stamp.lastIndex = 0;
    }
    for (const t of times) lines.push({ time: t, text: rest.trim() });
  }
  for (const l of lines) l.time = Math.max(0, l.time - offset);
  return lines.sort((a, b) => a.time - b.time);
}

// The index of the line sung at `time` (the last one starting at or before it), -1 before the first.
export function lineAt(lines, time) {
  let lo = 0, hi = lines.length - 1, found = -1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (lines[mid].time <= time + 1e-9) {
      found = mid;
      lo = mid + 1;
    } else hi = mid - 1;
  }
  return found;
}

// What each LRC line is in the lyrics, as the engine counts them (mm3/plan/lyric_edit.py): a sung line
// { line: n } (from 1, section tags not counted), or a section tag { section: "chorus 2" } (the second
// [chorus]). The LRC lists the lines in the lyrics' order, those the song never reached left out at the end.
export function lyricChoices(lines) {
  let sung = 0;
  const seen = {};
  return lines.map(({ text }) => {
    const tags = String(text ?? "").trim().match(/^(\[[^\]]*\])+$/);
    if (!tags) return { line: ++sung };
    const name = [...tags[0].matchAll(/\[([^\]]*)\]/g)].map((m) => m[1].trim().toLowerCase()).filter(Boolean).join(" ");
    seen[name] = (seen[name] ?? 0) + 1;
    return { section: `${name} ${seen[name]}` };
  });
}

// -- the schedule -------------------------------------------------------------------------------
// What to start for pieces [{ start, duration }] (seconds in the song, back to back) when song time 0
// sits at `anchor` on the clock and the clock reads `now`: [{ index, when, offset }] for every piece
// not yet over; a piece under way starts at once (`now + LEAD`) from the right place.
export function planStarts(pieces, anchor, now) {
  const out = [];
  const earliest = now + LEAD;
  pieces.forEach((p, index) => {
    const begin = anchor + p.start, end = begin + p.duration;
    if (end <= earliest) return;
    if (begin >= earliest) out.push({ index, when: begin, offset: 0 });
    else out.push({ index, when: earliest, offset: earliest - begin });
  });
  return out;
}

// The seconds of the song heard back to back from 0 (the pieces arrive in order; a gap ends it).
export function contiguousEnd(pieces) {
  let end = 0;
  for (const p of pieces) {
    if (p.start > end + 1e-6) break;
    end = Math.max(end, p.start + p.duration);
  }
  return end;
}

// Min and max per PEAKS_PER_SECOND-th of a second of a piece (both sides together).
export function peaksOf(channels, sampleRate) {
  const n = channels[0].length, step = Math.max(1, Math.round(sampleRate / PEAKS_PER_SECOND));
  const out = [];
  for (let a = 0; a < n; a += step) {
    let lo = 1, hi = -1;
    for (const ch of channels) {
      for (let i = a; i < Math.min(n, a + step); i++) {
        if (ch[i] < lo) lo = ch[i];
        if (ch[i] > hi) hi = ch[i];
      }
    }
    out.push([lo, hi]);
  }
  return out;
}

// One track (a song's variation) heard as its pieces come, on `ctx` (an AudioContext), through `output`
// (the view's volume; the speakers by default).
export class LivePlayer {
  constructor(ctx, output = ctx.destination) {
    this.ctx = ctx;
    this.output = output;
    this.pieces = []; // { start, duration, buffer, peaks }, in song order
    this.sources = [];
    this.playing = false;
    this.waiting = false; // playing, but the playhead reached the end of what has arrived
    this.position = 0; // seconds, while paused (or waiting)
    this.anchor = 0; // clock time of song time 0, while playing
    this.complete = false; // the last window arrived
    this.expected = 0; // seconds the song may last (the scale of the waveform until it is complete)
    this.lines = [];
  }

  get available() {
    return contiguousEnd(this.pieces);
  }

  get duration() {
    return this.complete ? this.available : Math.max(this.expected, this.available);
  }

  // The playhead, in seconds of the song.
  now() {
    if (!this.playing || this.waiting) return this.position;
    return Math.min(Math.max(0, this.ctx.currentTime - this.anchor), this.available);
  }

  // A decoded piece: { start, channels: [Float32Array], sampleRate }, start in samples of the song.
  add({ start, channels, sampleRate, last = false }) {
    const buffer = this.ctx.createBuffer(channels.length, channels[0].length, sampleRate);
    channels.forEach((ch, c) => buffer.copyToChannel(ch, c));
    const piece = { start: start / sampleRate, duration: channels[0].length / sampleRate, buffer,
                    peaks: peaksOf(channels, sampleRate) };
    const before = this.available;
    this.pieces.push(piece);
    this.pieces.sort((a, b) => a.start - b.start);
    if (last) this.complete = true;
    if (!this.playing) return piece;
    if (!this.waiting && this.ctx.currentTime + LEAD - this.anchor > before) { // ran out before `tick` saw it
      this._stopAll();
      this.position = before;
      this.waiting = true;
    }
    if (this.waiting) {
      this.waiting = false;
      this._startAt(this.position);
    } else {
      this._schedule(this.pieces.indexOf(piece));
    }
    return piece;
  }

  play() {
    if (this.playing) return;
    if (this.complete && this.position >= this.available - 1e-6) this.position = 0;
    this.playing = true;
    this.ctx.resume?.();
    this._startAt(this.position);
  }

  pause() {
    if (!this.playing) return;
    this.position = this.now();
    this.playing = this.waiting = false;
    this._stopAll();
  }

  seek(time) {
    const t = Math.min(Math.max(0, time), this.available);
    this.position = t;
    if (this.playing) {
      this._stopAll();
      this.waiting = false;
      this._startAt(t);
    }
  }

  // Called on every frame the player is drawn: notices the playhead reaching the end of what has
  // arrived (waiting for the next window, or the end of the song).
  tick() {
    if (!this.playing || this.waiting) return;
    const t = this.ctx.currentTime - this.anchor;
    if (t < this.available) return;
    this.position = this.available;
    this._stopAll();
    if (this.complete) this.playing = false;
    else this.waiting = true;
  }

  setLrc(text) {
    this.lines = parseLrc(text);
  }

  currentLine() {
    return lineAt(this.lines, this.now());
  }

  _startAt(position) {
    this.anchor = this.ctx.currentTime + LEAD - position;
    for (const s of planStarts(this.pieces, this.anchor, this.ctx.currentTime)) this._source(s);
    if (position >= this.available) this.waiting = !this.complete;
  }

  _schedule(index) {
    const plan = planStarts([this.pieces[index]], this.anchor, this.ctx.currentTime);
    for (const s of plan) this._source({ ...s, index });
  }

  _source({ index, when, offset }) {
    const src = this.ctx.createBufferSource();
    src.buffer = this.pieces[index].buffer;
    src.connect(this.output);
    src.start(when, offset);
    this.sources.push(src);
    src.onended = () => { this.sources = this.sources.filter((s) => s !== src); };
  }

  _stopAll() {
    for (const s of this.sources) {
      try { s.stop(); } catch (e) { /* not started yet, or over */ }
    }
    this.sources = [];
  }
}

// -- the widget ---------------------------------------------------------------------------------
export function clock(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

// The player widget's elements on a node; `makeContext` builds the AudioContext on first use.
export class PlayerView {
  constructor(makeContext) {
    this.makeContext = makeContext;
    this.tracks = new Map(); // "song.variation" -> LivePlayer
    this.selected = null;
    this.promptId = null;
    this.lrc = "";
    this.autoplay = true; // the first window starts playing (where the browser allows sound)
    this.volume = 1; // the slider's value
    this.noise = false; // this prompt's vocoder has random weights
    const el = (tag, css = "") => {
      const e = document.createElement(tag);
      if (css) e.style.cssText = css;
      return e;
    };
    this.root = el("div", "display: flex; flex-direction: column; gap: 4px; font-size: 12px; padding: 2px;");
    const bar = el("div", "display: flex; gap: 6px; align-items: center;");
    this.button = el("button", "min-width: 28px;");
    this.button.textContent = "▶";
    this.button.title = "Play or pause the song as it is being made";
    this.button.onclick = () => this.toggle();
    this.time = el("span", "font-variant-numeric: tabular-nums; opacity: 0.85;");
    this.time.textContent = "waiting for the first window";
    this.choice = el("select", "display: none; max-width: 140px;");
    this.choice.title = "Which song and variation to hear";
    this.choice.onchange = () => this.select(this.choice.value);
    this.slider = el("input", "width: 70px; margin-left: auto;");
    Object.assign(this.slider, { type: "range", min: "0", max: "1", step: "0.05", value: "1", title: "Volume" });
    this.slider.oninput = () => this.setVolume(Number(this.slider.value));
    bar.append(this.button, this.time, this.choice, this.slider);
    this.note = el("div", "display: none; color: var(--error-text, #f66); line-height: 1.3;");
    this.note.textContent = NOISE_NOTE;
    this.canvas = el("canvas", `width: 100%; height: ${WAVE_HEIGHT}px; cursor: pointer; background: rgba(0,0,0,0.25);`);
    this.canvas.height = WAVE_HEIGHT;
    this.canvas.title = "Click to jump there";
    this.canvas.onclick = (e) => {
      const p = this.player, rect = this.canvas.getBoundingClientRect?.();
      if (!p || !rect?.width) return;
      p.seek(((e.clientX - rect.left) / rect.width) * p.duration);
      this.draw();
    };
    this.lyrics = el("div", `max-height: ${LYRICS_HEIGHT}px; overflow-y: auto; display: none; line-height: 1.4;`);
    this.root.append(bar, this.note, this.canvas, this.lyrics);
  }

  get player() {
    return this.tracks.get(this.selected) ?? null;
  }

  // The widget's height: the controls and the waveform, and the lyrics while there are some.
  height() {
    return PLAYER_HEIGHT + (this.lineEls?.length ? LYRICS_HEIGHT + 4 : 0) + (this.noise ? NOTE_HEIGHT : 0);
  }

  // What the speakers get: the slider's volume, a tenth of it for noise.
  get gainValue() {
    return this.volume * (this.noise ? QUIET : 1);
  }

  setVolume(volume) {
    this.volume = Math.min(Math.max(0, volume), 1);
    this.slider.value = String(this.volume);
    if (this.gain) this.gain.gain.value = this.gainValue;
  }

  // Whether the prompt's song is noise from random weights: said, and played quietly.
  setNoise(noise) {
    this.noise = !!noise;
    this.note.style.display = this.noise ? "" : "none";
    this.setVolume(this.volume);
  }

  // One "mm3.window" message with its decoded audio; a new prompt starts over.
  add(message, decoded) {
    if (message.prompt_id !== this.promptId) this.reset(message.prompt_id);
    if (message.noise && !this.noise) this.setNoise(true); // before a sound is made
    const key = `${message.song}.${message.variation}`;
    let track = this.tracks.get(key);
    if (!track) {
      if (!this.ctx) {
        this.ctx = this.makeContext(decoded.sampleRate);
        this.gain = this.ctx.createGain();
        this.gain.connect(this.ctx.destination);
        this.setVolume(this.volume);
      }
      track = new LivePlayer(this.ctx, this.gain);
      track.setLrc(this.lrc);
      this.tracks.set(key, track);
      this._options();
    }
    track.expected = Math.max(track.expected, message.duration ?? 0);
    track.add({ start: message.start, channels: decoded.channels, sampleRate: decoded.sampleRate, last: message.last });
    if (this.selected === null) {
      this.selected = key;
      if (this.autoplay) track.play();
    }
    this.draw();
    return track;
  }

  reset(promptId) {
    for (const t of this.tracks.values()) t.pause();
    this.tracks.clear();
    this.selected = null;
    this.promptId = promptId;
    this.setNoise(false);
    this._options();
  }

  select(key) {
    const was = this.player, playing = was?.playing;
    const at = was ? was.now() : 0;
    was?.pause();
    this.selected = key;
    const now = this.player;
    if (now) {
      now.seek(at);
      if (playing) now.play();
    }
    this.draw();
  }

  toggle() {
    const p = this.player;
    if (!p) return;
    if (p.playing) p.pause();
    else p.play();
    this.draw();
  }

  setLrc(text) {
    this.lrc = text ?? "";
    for (const t of this.tracks.values()) t.setLrc(this.lrc);
    this._lines();
    this.draw();
  }

  _options() {
    this.choice.replaceChildren?.();
    for (const key of this.tracks.keys()) {
      const [song, variation] = key.split(".");
      const o = document.createElement("option");
      o.value = key;
      o.textContent = `song ${+song + 1}, variation ${+variation + 1}`;
      this.choice.append?.(o);
    }
    this.choice.style.display = this.tracks.size > 1 ? "" : "none";
  }

  _lines() {
    this.lyrics.replaceChildren?.();
    const lines = parseLrc(this.lrc);
    const choices = lyricChoices(lines);
    this.lyrics.style.display = lines.length ? "" : "none";
    this.lineEls = lines.map((line, i) => {
      const row = document.createElement("div");
      row.textContent = line.text || "♪";
      row.style.cursor = "pointer";
      row.title = `${clock(line.time)}: click to jump here` +
        (this.onChoose ? ` and to edit this ${choices[i].line ? "line" : "section"} (MM3 Repaint, Change a Line)` : "");
      row.onclick = () => {
        this.player?.seek(line.time);
        this.onChoose?.(choices[i]);
        this.draw();
      };
      this.lyrics.append?.(row);
      return row;
    });
  }

  // Redraws the waveform, the playhead, the time and the lit lyric line; keeps itself going while playing.
  draw() {
    const p = this.player;
    if (!p) return;
    p.tick();
    this.button.textContent = p.playing ? "❚❚" : "▶";
    const state = p.waiting ? " (waiting for the next window)" : "";
    this.time.textContent = `${clock(p.now())} / ${clock(p.available)}${p.complete ? "" : " so far"}${state}`;
    const g = this.canvas.getContext?.("2d");
    if (g) {
      const w = (this.canvas.width = this.canvas.clientWidth || 300), h = this.canvas.height;
      g.clearRect(0, 0, w, h);
      const total = Math.max(p.duration, 1e-3);
      g.fillStyle = "rgba(120, 180, 255, 0.8)";
      for (const piece of p.pieces) {
        const x0 = (piece.start / total) * w, dx = (piece.duration / total) * w / piece.peaks.length;
        piece.peaks.forEach(([lo, hi], i) => {
          g.fillRect(x0 + i * dx, h / 2 - (hi * h) / 2, Math.max(1, dx), Math.max(1, ((hi - lo) * h) / 2));
        });
      }
      g.fillStyle = "#fff";
      g.fillRect((p.now() / total) * w, 0, 1, h);
    }
    const current = p.currentLine();
    (this.lineEls ?? []).forEach((row, i) => {
      row.style.fontWeight = i === current ? "700" : "";
      row.style.opacity = i === current ? "1" : "0.6";
    });
    if (current >= 0 && current !== this.litLine) this.lineEls?.[current]?.scrollIntoView?.({ block: "nearest" });
    this.litLine = current;
    if (p.playing && !this.frame) {
      this.frame = requestAnimationFrame(() => {
        this.frame = null;
        this.draw();
      });
    }
  }
}
