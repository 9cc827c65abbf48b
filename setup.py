"""ssl_engine: a phase/epoch training engine for self-supervised and supervised vision models."""

import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("ssl_engine/__init__.py").read_text()).group(1)

setup(
    name="ssl_engine",
    version=version,
    description="VISSL-style phase/epoch training engine for self-supervised vision on current PyTorch",
    long_description=Path("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ssl_engine", "ssl_engine.*"]),
    package_data={"ssl_engine.config": ["defaults.yaml"]},
    include_package_data=True,
    install_requires=[
        "torch",
        "torchvision",
        "classy-vision==0.7.0",
        "fvcore",
        "hydra-core>=1.3",
        "submitit",
        "numpy",
        "tqdm",
        "tensorboard",
        "scikit-learn",
    ],
    # bench: the peers benchmarks/peers.py runs next to the engine (make bench installs them) and
    # py-spy, the sampling profiler benchmarks/README.md uses to read a running loop
    extras_require={"dev": ["pytest", "pytest-xdist", "hypothesis"], "bench": ["pytorch-ignite", "lightning", "py-spy"]},
)
