# Production image for the api, worker and relayer processes (one image, three commands).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY backend backend
COPY relayer relayer
COPY payintent payintent
COPY devnet devnet
RUN pip install --no-cache-dir -c constraints.txt . && useradd --system --home /app payintent
USER payintent
EXPOSE 8000
CMD ["payintent", "serve", "--host", "0.0.0.0", "--port", "8000"]
