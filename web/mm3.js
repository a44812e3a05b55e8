// MiniMax Music 3 (GGUF) nodes in the editor: a read-only text box for what a node reports (prompt
// token count with the cleaned caption and normalised lyrics, the AR plan per song, the codes file
// written or loaded) and an audio player on Save Song (ComfyUI's own AUDIO_UI widget).
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const TEXT_NODES = new Set(["MM3PromptAssemble", "MM3ARPlan", "MM3LoadAudioCodes", "MM3SaveAudioCodes"]);
const INFO = "mm3_info";

function showText(node, lines) {
  const text = Array.isArray(lines) ? lines.join("\n") : String(lines ?? "");
  let widget = node.widgets?.find((w) => w.name === INFO);
  if (!widget) {
    // Added last and never serialized, so saved widgets_values keep their positions.
    widget = ComfyWidgets.STRING(node, INFO, ["STRING", { multiline: true }], app).widget;
    widget.serialize = false;
    if (widget.inputEl) {
      widget.inputEl.readOnly = true;
      widget.inputEl.style.opacity = 0.75;
    }
  }
  widget.value = text;
  requestAnimationFrame(() => {
    const size = node.computeSize();
    node.setSize([Math.max(node.size[0], size[0]), Math.max(node.size[1], size[1])]);
    node.setDirtyCanvas?.(true, true);
  });
}

app.registerExtension({
  name: "MM3.GGUF.Nodes",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name === "MM3SaveSong") {
      nodeData.input.required.audioUI = ["AUDIO_UI", {}]; // the player core gives SaveAudio
    }
    if (!TEXT_NODES.has(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      if (message?.text) showText(this, message.text);
    };
  },
});
