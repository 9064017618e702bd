"""Every metric name an evaluation reports, and which direction is better for each."""

from __future__ import annotations

from empatheia_jax.eval import speech as speech_eval
from empatheia_jax.eval import video as video_eval

# Metric names, in the order tables show them.
LOSS_METRICS = ("eval_loss", "emp", "ppl", "reply_ppl", "signal_ce", "ccl_speech", "ccl_video", "sal_speech",
                "sal_video", "cls_emotion", "cls_age", "cls_gender", "cls_timbre", "kl")


# CoE step 2 against the gold emotion: decoded freely, voted, by likelihood, by the emotion head, combined
# (`eval.emotion_head`); first in tables.
EMOTION_METRICS = ("emotion_acc_text", "emotion32_acc_text", "emotion_acc_vote", "emotion32_acc_vote",
                   "emotion_acc_scored", "emotion32_acc_scored", "emotion_acc_head", "emotion32_acc_head",
                   "emotion_acc_combined", "emotion32_acc_combined")


TEXT_METRICS = (*EMOTION_METRICS, "coe_parse_rate", "emotion_scored_rate",
                "emotion_parse_rate", "emotion32_parse_rate", "signal_rate", "dist1_corpus",
                "dist2_corpus", "dist1_reply", "dist2_reply", "repetition_rate", "reply_words",
                "reply_bleu1", "reply_bleu2", "reply_rouge_l", "question_rate", "reuse_rate",
                "duplicate_rate", "age_acc_text", "gender_acc_text", "timbre_acc_text")
"""question_rate and reuse_rate have no better direction (the gold listener asks in about a third of its
replies): the baseline column gives the gold replies' figures to read them against."""


CLASS_METRICS = ("emotion_acc_cls", "age_acc", "gender_acc", "timbre_acc")


FEATURE_METRICS = ("speech_content_l2", "video_content_l2", "speech_style_l2", "video_style_l2",
                   "speech_content_cos", "video_content_cos", "speech_style_cos", "video_style_cos")


COUNT_METRICS = ("num_examples", "num_generated", "skipped_examples", "asr_utterances")


INPUT_METRICS = ("input_wer",)
"""`eval --asr`: Whisper tiny.en's WER on the history utterances the model read, against their typed text (a
property of the input, not of the model: no better direction), with the count of utterances heard
(`asr_utterances`, a count)."""


METRICS = (*EMOTION_METRICS, *CLASS_METRICS, *FEATURE_METRICS, *speech_eval.SPEECH_METRICS,
           *video_eval.VIDEO_METRICS, *TEXT_METRICS[len(EMOTION_METRICS):], *LOSS_METRICS, *INPUT_METRICS,
           *COUNT_METRICS)


HIGHER_IS_BETTER = frozenset({*CLASS_METRICS, *(set(TEXT_METRICS) - {"repetition_rate", "reply_words",
                                                                      "question_rate", "reuse_rate",
                                                                      "duplicate_rate"}),
                              "speech_content_cos", "video_content_cos",
                              "speech_style_cos", "video_style_cos", *speech_eval.HIGHER_IS_BETTER,
                              *video_eval.HIGHER_IS_BETTER})


LOWER_IS_BETTER = frozenset({*LOSS_METRICS, "duplicate_rate", "speech_content_l2", "video_content_l2",
                             "speech_style_l2", "video_style_l2", *speech_eval.LOWER_IS_BETTER,
                             *video_eval.LOWER_IS_BETTER})


LABELS = ("emotion", "age", "gender", "timbre")


ACC_NAME = {"emotion": "emotion_acc_cls", "age": "age_acc", "gender": "gender_acc", "timbre": "timbre_acc"}
