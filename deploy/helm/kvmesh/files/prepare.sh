set -eu
models="${MODELS_DIR:-/models}"
dest="$models/checkpoints/$MODEL_NAME"
if [ -f "$dest/config.json" ]; then
  echo "kvmesh-model: $dest is ready"
  exit 0
fi
src="$models/incoming/$MODEL_NAME.gguf"
if [ -n "${MODEL_URL:-}" ] && [ ! -f "$src" ]; then
  mkdir -p "$models/incoming"
  python -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
    "$MODEL_URL" "$src.part"
  mv "$src.part" "$src"
fi
if [ ! -f "$src" ]; then
  src="$(python -c 'from kvmesh.models.default import default_gguf_file; print(default_gguf_file())')"
fi
mkdir -p "$models/checkpoints"
kvmesh model convert "$src" "$dest"
echo "kvmesh-model: $dest converted from $src"
