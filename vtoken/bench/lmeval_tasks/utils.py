"""vtoken_gen's score: a hit when the target is a word of the answer (case ignored), so "The capital of France is
Paris." counts, as a person would count it."""

import re


def process_results(doc, results):
    answer = results[0] if results else ""
    words = re.findall(r"[a-z]+|[0-9]+", answer.lower())
    return {"contains": int(str(doc["answer"]).lower() in words)}
