/* A serving client on TensorFlow's C API: what TF Serving, and the Go, Java and Rust bindings,
 * use to load a SavedModel (TF_LoadSessionFromSavedModel, the C++ loader).
 *
 *   serve_c_api MODEL_DIR INPUT_TENSOR INPUT_FILE ROWS COLS OUTPUT_TENSOR [OUTPUT_TENSOR...]
 *
 * loads MODEL_DIR with tag "serve", feeds INPUT_TENSOR (e.g. serving_default_x:0) a float32
 * [ROWS, COLS] batch read from INPUT_FILE (raw little-endian float32), fetches each
 * OUTPUT_TENSOR and prints, per output, a line "output NAME NDIMS D0 D1 ..." and a line of
 * its values (float32, %.9g: exact). Errors go to stderr with exit status 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensorflow/c/c_api.h"

static int fail(const char *what, TF_Status *status) {
  fprintf(stderr, "%s: %s\n", what, status ? TF_Message(status) : "");
  return 1;
}

/* "name:index" -> operation and output index in graph. */
static int lookup(TF_Graph *graph, const char *tensor, TF_Output *out) {
  char name[1024];
  const char *colon = strrchr(tensor, ':');
  size_t len = colon ? (size_t)(colon - tensor) : strlen(tensor);
  if (len >= sizeof(name)) return 0;
  memcpy(name, tensor, len);
  name[len] = '\0';
  out->oper = TF_GraphOperationByName(graph, name);
  out->index = colon ? atoi(colon + 1) : 0;
  return out->oper != NULL;
}

int main(int argc, char **argv) {
  if (argc < 7) {
    fprintf(stderr, "usage: %s MODEL_DIR INPUT_TENSOR INPUT_FILE ROWS COLS OUTPUT_TENSOR...\n", argv[0]);
    return 2;
  }
  const char *model_dir = argv[1];
  int64_t dims[2] = {atoll(argv[4]), atoll(argv[5])};
  int n_out = argc - 6;
  size_t n_values = (size_t)(dims[0] * dims[1]);

  TF_Status *status = TF_NewStatus();
  TF_Graph *graph = TF_NewGraph();
  TF_SessionOptions *options = TF_NewSessionOptions();
  const char *tags[] = {"serve"};
  TF_Session *session = TF_LoadSessionFromSavedModel(options, NULL, model_dir, tags, 1, graph, NULL, status);
  if (TF_GetCode(status) != TF_OK) return fail("load", status);

  TF_Output input;
  if (!lookup(graph, argv[2], &input)) {
    fprintf(stderr, "no tensor %s in the graph\n", argv[2]);
    return 1;
  }
  TF_Output *outputs = calloc((size_t)n_out, sizeof(TF_Output));
  for (int k = 0; k < n_out; k++) {
    if (!lookup(graph, argv[6 + k], &outputs[k])) {
      fprintf(stderr, "no tensor %s in the graph\n", argv[6 + k]);
      return 1;
    }
  }

  TF_Tensor *batch = TF_AllocateTensor(TF_FLOAT, dims, 2, n_values * sizeof(float));
  FILE *f = fopen(argv[3], "rb");
  if (!f || fread(TF_TensorData(batch), sizeof(float), n_values, f) != n_values) {
    fprintf(stderr, "%s: cannot read %zu float32 values\n", argv[3], n_values);
    return 1;
  }
  fclose(f);

  TF_Tensor **results = calloc((size_t)n_out, sizeof(TF_Tensor *));
  TF_SessionRun(session, NULL, &input, &batch, 1, outputs, results, n_out, NULL, 0, NULL, status);
  if (TF_GetCode(status) != TF_OK) return fail("run", status);

  for (int k = 0; k < n_out; k++) {
    if (TF_TensorType(results[k]) != TF_FLOAT) {
      fprintf(stderr, "%s: not a float32 tensor\n", argv[6 + k]);
      return 1;
    }
    int nd = TF_NumDims(results[k]);
    printf("output %s %d", argv[6 + k], nd);
    for (int d = 0; d < nd; d++) printf(" %lld", (long long)TF_Dim(results[k], d));
    printf("\n");
    const float *v = TF_TensorData(results[k]);
    size_t n = TF_TensorElementCount(results[k]);
    for (size_t i = 0; i < n; i++) printf(i ? " %.9g" : "%.9g", v[i]);
    printf("\n");
    TF_DeleteTensor(results[k]);
  }
  TF_DeleteTensor(batch);
  TF_CloseSession(session, status);
  TF_DeleteSession(session, status);
  TF_DeleteSessionOptions(options);
  TF_DeleteGraph(graph);
  TF_DeleteStatus(status);
  free(outputs);
  free(results);
  return 0;
}
