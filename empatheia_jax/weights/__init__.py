"""Weights in and out: the converted-checkpoint folder, the HF tensor-name table, HF/GGUF reading,
PEFT/merged and Empatheia exports."""
