"""The four engineering write-ups the book follows (in Chinese), and the figures of theirs that
the chapters set beside our own: one place to cite them from, by title and link.

Their copies are in the project's reference folder; where a post's copy gives no address of its
own, ``link`` is the project the post belongs to, as the copy names it, or None.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Post:
    key: str
    title: str  # as the post gives it
    english: str  # what the title says
    link: str | None
    setup: str  # the hardware and model its figures come from

    def cite(self) -> str:
        """Markdown: the title (linked where a link is known), its English gloss and setup."""
        title = f"[{self.title}]({self.link})" if self.link else f"*{self.title}*"
        return f"{title} ({self.english}; {self.setup})"


POSTS: dict[str, Post] = {post.key: post for post in (
    Post("mini-infer", "mini-infer系统实战-05-Decode Profiling:还差的 12% 性能到底丢在哪里",
         "mini-infer in practice, part 5, decode profiling: where did the last 12% go", None,
         "RTX 4090, Qwen2.5-7B-Instruct fp16"),
    Post("roseinfer-perf", "从零实现 LLM Inference：017. Performance",
         "LLM inference from scratch, 017: performance", None,
         "roseinfer on a GPU, GPT-2 small"),
    Post("roseinfer-paged", "roseinfer: paged attention decode (T=1) fast path",
         "the post's copy gives no title of its own; this is its subject", None,
         "roseinfer on a GPU, HF GPT-2, context 1024"),
    Post("wde", "对 Decoding (chat) models 推理性能调优",
         "performance tuning for decoding (chat) models", "https://github.com/noooop/wde",
         "one RTX 4090, Qwen2.5-7B-Instruct fp8, and a 1.5B model in bf16"),
)}


def cite(key: str) -> str:
    """The citation of one post, for a chapter's markdown."""
    return POSTS[key].cite()
