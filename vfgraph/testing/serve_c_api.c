/* A serving client on TensorFlow's C API: what TF Serving, and the Go, Java and Rust bindings,
 * use to load a SavedModel (TF_LoadSessionFromSavedModel, the C++ loader).
 *
 *   serve_c_api MODEL_DIR REQUEST_FILE
 *
 * loads MODEL_DIR with tag "serve" and runs one request described by REQUEST_FILE, a text file:
 *
 *   inputs N
 *   TENSOR DTYPE RANK D0 D1 ... DATA_FILE      (N lines; DTYPE: TF_DataType number,
 *   outputs M                                   DATA_FILE: the raw little-endian values)
 *   TENSOR                                      (M lines)
 *
 * and prints, per output, a line "output TENSOR DTYPE NDIMS D0 D1 ..." and a line of its values
 * (float and double as %.17g, integers and booleans as integers). Errors go to stderr, exit 1.
 */
#include <stdint.h>
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

static void print_value(TF_DataType t, const void *data, size_t i) {
  switch (t) {
    case TF_FLOAT: printf("%.17g", (double)((const float *)data)[i]); break;
    case TF_DOUBLE: printf("%.17g", ((const double *)data)[i]); break;
    case TF_INT32: printf("%d", ((const int32_t *)data)[i]); break;
    case TF_INT64: printf("%lld", (long long)((const int64_t *)data)[i]); break;
    case TF_BOOL: printf("%d", (int)((const unsigned char *)data)[i]); break;
    default: printf("nan"); break;
  }
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s MODEL_DIR REQUEST_FILE\n", argv[0]);
    return 2;
  }
  FILE *req = fopen(argv[2], "r");
  if (!req) {
    fprintf(stderr, "%s: cannot open\n", argv[2]);
    return 1;
  }
  TF_Status *status = TF_NewStatus();
  TF_Graph *graph = TF_NewGraph();
  TF_SessionOptions *options = TF_NewSessionOptions();
  const char *tags[] = {"serve"};
  TF_Session *session = TF_LoadSessionFromSavedModel(options, NULL, argv[1], tags, 1, graph, NULL, status);
  if (TF_GetCode(status) != TF_OK) return fail("load", status);

  int n_in = 0, n_out = 0;
  if (fscanf(req, " inputs %d", &n_in) != 1 || n_in < 0 || n_in > 256) return fail("request: inputs", NULL);
  TF_Output *inputs = calloc((size_t)n_in + 1, sizeof(TF_Output));
  TF_Tensor **values = calloc((size_t)n_in + 1, sizeof(TF_Tensor *));
  for (int k = 0; k < n_in; k++) {
    char tensor[1024], path[4096];
    int dtype = 0, rank = 0;
    int64_t dims[16];
    if (fscanf(req, " %1023s %d %d", tensor, &dtype, &rank) != 3 || rank < 0 || rank > 16)
      return fail("request: input line", NULL);
    size_t n = 1;
    for (int d = 0; d < rank; d++) {
      long long v;
      if (fscanf(req, " %lld", &v) != 1) return fail("request: dimension", NULL);
      dims[d] = v;
      n *= (size_t)v;
    }
    if (fscanf(req, " %4095s", path) != 1) return fail("request: data file", NULL);
    if (!lookup(graph, tensor, &inputs[k])) {
      fprintf(stderr, "no tensor %s in the graph\n", tensor);
      return 1;
    }
    size_t bytes = n * TF_DataTypeSize((TF_DataType)dtype);
    values[k] = TF_AllocateTensor((TF_DataType)dtype, dims, rank, bytes);
    FILE *f = fopen(path, "rb");
    if (!f || (bytes && fread(TF_TensorData(values[k]), 1, bytes, f) != bytes)) {
      fprintf(stderr, "%s: cannot read %zu bytes\n", path, bytes);
      return 1;
    }
    fclose(f);
  }
  if (fscanf(req, " outputs %d", &n_out) != 1 || n_out < 1 || n_out > 256) return fail("request: outputs", NULL);
  TF_Output *outputs = calloc((size_t)n_out, sizeof(TF_Output));
  char (*names)[1024] = calloc((size_t)n_out, sizeof(*names));
  for (int k = 0; k < n_out; k++) {
    if (fscanf(req, " %1023s", names[k]) != 1) return fail("request: output line", NULL);
    if (!lookup(graph, names[k], &outputs[k])) {
      fprintf(stderr, "no tensor %s in the graph\n", names[k]);
      return 1;
    }
  }
  fclose(req);

  TF_Tensor **results = calloc((size_t)n_out, sizeof(TF_Tensor *));
  TF_SessionRun(session, NULL, inputs, values, n_in, outputs, results, n_out, NULL, 0, NULL, status);
  if (TF_GetCode(status) != TF_OK) return fail("run", status);

  for (int k = 0; k < n_out; k++) {
    TF_DataType t = TF_TensorType(results[k]);
    int nd = TF_NumDims(results[k]);
    printf("output %s %d %d", names[k], (int)t, nd);
    for (int d = 0; d < nd; d++) printf(" %lld", (long long)TF_Dim(results[k], d));
    printf("\n");
    const void *v = TF_TensorData(results[k]);
    size_t n = (size_t)TF_TensorElementCount(results[k]);
    for (size_t i = 0; i < n; i++) {
      if (i) printf(" ");
      print_value(t, v, i);
    }
    printf("\n");
    TF_DeleteTensor(results[k]);
  }
  for (int k = 0; k < n_in; k++) TF_DeleteTensor(values[k]);
  TF_CloseSession(session, status);
  TF_DeleteSession(session, status);
  TF_DeleteSessionOptions(options);
  TF_DeleteGraph(graph);
  TF_DeleteStatus(status);
  free(inputs);
  free(values);
  free(outputs);
  free(names);
  free(results);
  return 0;
}
