from sglang.srt.configs.deepseek_v4 import ConfigError, DeepseekV4Config

__all__ = ["ConfigError", "DeepseekV4Config"]
