#!/bin/sh
# Runs while deploy/Containerfile builds, in two steps so that the dependencies' layer
# is rebuilt only when pyproject.toml changes:
#   container-install.sh dependencies   the requirements of both distributions (the client in
#                                       /src/client and the server in /src) into /opt/tokenwire
#   container-install.sh project        both distributions from /src, and the baked model if asked
set -eu
step=$1

# Only the index settings that were given reach pip: an empty PIP_INDEX_URL would mean no index.
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST; do
    eval "value=\${$name:-}"
    if [ -z "$value" ]; then unset "$name"; else export "$name"; fi
done
if [ -s /run/secrets/pip-cert ]; then
    export PIP_CERT=/run/secrets/pip-cert
fi
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
pip=/opt/tokenwire/bin/pip

case "$VARIANT" in
    cpu | cuda) ;;
    *)
        echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2
        exit 2
        ;;
esac

dependencies() {
    python3 -m venv /opt/tokenwire
    # The requirements of both pyproject.toml files and the server's extra for this variant
    # (cpu: onnxruntime; cuda: onnxruntime-gpu with CUDA and cuDNN, which install the same
    # module, so exactly one is named), less the project's own distributions: those are
    # installed from the source in the next step.
    /opt/tokenwire/bin/python - "$VARIANT" > /tmp/requirements.txt <<'PY'
import re
import sys
import tomllib

for path, extra in (("/src/client/pyproject.toml", None), ("/src/pyproject.toml", sys.argv[1])):
    with open(path, "rb") as file:
        project = tomllib.load(file)["project"]
    requirements = project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])
    for requirement in requirements:
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()
        if not name.startswith("tokenwire"):
            print(requirement)
PY
    "$pip" install -r /tmp/requirements.txt
    rm /tmp/requirements.txt
}

project() {
    # The dependencies are in place from the previous step, read from these same files.
    "$pip" install --no-deps /src/client /src
    # Fails the build if the requirements read in the previous step missed one.
    "$pip" check
    mkdir -p /opt/tokenwire-models
    if [ -n "$BAKE_MODEL" ]; then
        # CUDA's GroupQueryAttention is half precision only.
        dtype=float32
        if [ "$VARIANT" = cuda ]; then dtype=float16; fi
        TOKENWIRE_HOME=/tmp/tokenwire-home /opt/tokenwire/bin/tokenwire pull "$BAKE_MODEL" --dtype "$dtype"
        # The directory's name is the name clients use.
        mv /tmp/tokenwire-home/models/* "/opt/tokenwire-models/$BAKE_MODEL"
        rm -rf /tmp/tokenwire-home
    fi
}

case "$step" in
    dependencies) dependencies ;;
    project) project ;;
    *)
        echo "usage: container-install.sh dependencies|project" >&2
        exit 2
        ;;
esac
