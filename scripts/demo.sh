#!/usr/bin/env bash
# One command from a fresh clone to the main demo: installs missing Debian packages, builds
# (Release), exports the split-ResNet50 models and runs two tasks sharing blocks 1-3 in threads.
# Extra arguments go to the demo (e.g. --requests 50 --threads 2).
source "$(dirname "$0")/common.sh"
bf_setup
"$PYTHON" "$ROOT/scripts/export_models.py" --out "$BUILD_DIR/models"
"$BUILD_DIR/examples/resnet_demo" --models "$BUILD_DIR/models" "$@"
