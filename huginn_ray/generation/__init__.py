"""Generation with adaptive compute over a RecurrentGPT: requests and sampling (`requests`), exit criteria
(`exits`), the key/value caches of sequences at different depths (`caches`), the batched loop step (`stepping`),
`generate` for a batch of prompts (`generate`) and the continuous-depth-batching serving engine (`engine`)."""
