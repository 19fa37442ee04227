"""Images in, text out: what a vision-language request carries through the engine.

`inputs`: per-image features (processed pixels, placeholder range, content hash); `processor`:
a model folder's Hugging Face processor turning a prompt and images into token ids and features;
`media`: loading images from data URLs, local files and (when allowed) remote URLs.
"""
