"""The EAGLE-3 draft: its attention contexts (``attention``), the architecture (``model``), its checkpoint in
speculators' format (``checkpoint``) and in the EAGLE/SGLang layout (``eagle``)."""
