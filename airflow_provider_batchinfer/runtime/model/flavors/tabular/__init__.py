"""Tabular flavors (scikit-learn, XGBoost, LightGBM, ONNX) and their shared input handling."""
